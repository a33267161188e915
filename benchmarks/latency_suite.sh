#!/usr/bin/env bash
# Serving latency on one GPU: median TTFT of short prompts at low load, and P99 inter-token latency under load.
#   bash benchmarks/latency_suite.sh [server flags...]
# Env: MODEL (default the 8B shape, dummy weights), TOK (a tokenizer folder: $RS_BENCH_TOK), PORT (31000),
# OUT (JSON folder, default /tmp), TTFT_N / ITL_N (prompt counts), ITL_IN / ITL_OUT (lengths, for a CPU dry run),
# TTFT_LENS (prompt lengths of the TTFT runs, default "16 128 512"; TTFT_IN, one length, also works), START_S
# (seconds to wait for the server).
# Steps: a server with the given flags; ITL: 1024-token prompts, 256 output tokens, at 16 requests/s; TTFT: for each
# length, prompts of that many tokens at 1 request/s, 16 output tokens (one at a time: batch 1). Each step prints
# bench_serving's table (with the server's TTFT stages: the server runs with --enable-metrics); the server's log tail too.
set -u
MODEL=${MODEL:-radixserve/configs/shapes/llama-3.1-8b}
TOK=${TOK:-${RS_BENCH_TOK:-}}
PORT=${PORT:-31000}
OUT=${OUT:-/tmp}
PY=${PY:-python3}
LOAD=()
[ -f "$MODEL/config.json" ] && [ ! -f "$MODEL/model.safetensors" ] && [ ! -f "$MODEL/model.safetensors.index.json" ] \
  && LOAD=(--load-format dummy)
TOKARG=()
[ -n "$TOK" ] && TOKARG=(--tokenizer-path "$TOK")
$PY -m radixserve.launch_server --model-path "$MODEL" "${LOAD[@]}" "${TOKARG[@]}" --port "$PORT" --enable-metrics "$@" \
  > "$OUT/latency_server.log" 2>&1 &
SERVER=$!
echo $SERVER > "$OUT/latency_server.pid"
trap 'kill $SERVER 2>/dev/null' EXIT TERM INT
t=$(date +%s)
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
  if ! kill -0 $SERVER 2>/dev/null || [ $(( $(date +%s) - t )) -gt "${START_S:-120}" ]; then
    echo "server did not come up"; tail -n 30 "$OUT/latency_server.log"; kill $SERVER 2>/dev/null; exit 1
  fi
  sleep 0.5
done
echo "server up in $(( $(date +%s) - t ))s"
bench() { local name=$1; shift
  echo "=== $name"
  $PY -m radixserve.bench_serving --base-url "http://127.0.0.1:$PORT" --backend radixserve \
    ${TOK:+--tokenizer "$TOK"} --disable-tqdm --output-file "$OUT/latency_$name.json" "$@" 2>&1 \
    | grep -v '^\s*$' | tail -n 40
}
bench itl --num-prompts "${ITL_N:-128}" --request-rate 16 --random-input-len "${ITL_IN:-1024}" \
  --random-output-len "${ITL_OUT:-256}" \
  --random-range-ratio 1.0 --seed 2
for len in ${TTFT_LENS:-${TTFT_IN:-16 128 512}}; do
  bench "ttft_$len" --num-prompts "${TTFT_N:-8}" --request-rate 1 --random-input-len "$len" --random-output-len 16 \
    --random-range-ratio 1.0 --seed 3
done
grep -i "captured\|compile\|KV pool" "$OUT/latency_server.log" | cut -c1-200 | tail -n 5
kill $SERVER; wait $SERVER 2>/dev/null
