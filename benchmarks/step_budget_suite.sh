#!/usr/bin/env bash
# P99 inter-token latency under load for several server configurations in one run, on one GPU:
#   bash benchmarks/step_budget_suite.sh "" "--step-token-budget 0" "--step-token-budget 384"
# Every argument is one server's extra flags (""= the defaults). The servers start at the same time, each with a
# KV pool of TOKENS tokens (MEM, the --mem-fraction-static, then only sets the memory kept free), then the ITL load
# (ITL_N prompts of 1024 in / 256 out at 16 requests/s) runs against each in turn, so only one of them computes at
# a time; then the TTFT load (128-token prompts at 1 request/s) against the first. Each step prints a one-line
# summary; the servers' start-up lines too.
# Env: MODEL (default the 8B shape, dummy weights; set and empty: the embedded model), TOK (tokenizer folder:
# $RS_BENCH_TOK), PORT0 (31100), OUT (JSON and logs, default /tmp), MEM (0.85), TOKENS (150000), ITL_N (96),
# ITL_IN / ITL_OUT / TTFT_IN (lengths, for a CPU dry run), TTFT_N (6; 0 skips), START_S (seconds to wait for the
# servers), PY (python3), DEVICE_ARGS (e.g. "--device cpu").
set -u
MODEL=${MODEL-radixserve/configs/shapes/llama-3.1-8b}
TOK=${TOK:-${RS_BENCH_TOK:-}}
PORT0=${PORT0:-31100}
OUT=${OUT:-/tmp}
PY=${PY:-python3}
MEM=${MEM:-0.85}
TOKENS=${TOKENS:-150000}
LOAD=()
[ -n "$MODEL" ] && LOAD=(--model-path "$MODEL")
[ -n "$MODEL" ] && [ -f "$MODEL/config.json" ] && [ ! -f "$MODEL/model.safetensors" ] && [ ! -f "$MODEL/model.safetensors.index.json" ] \
  && LOAD+=(--load-format dummy)
TOKARG=()
[ -n "$TOK" ] && TOKARG=(--tokenizer-path "$TOK")
[ $# -eq 0 ] && set -- ""
PIDS=()
i=0
for flags in "$@"; do
  port=$((PORT0 + i))
  # shellcheck disable=SC2086  # the flags are meant to split
  $PY -m radixserve.launch_server "${LOAD[@]}" "${TOKARG[@]}" --port "$port" \
    --mem-fraction-static "$MEM" --max-total-tokens "$TOKENS" ${DEVICE_ARGS:-} $flags > "$OUT/budget_server_$i.log" 2>&1 &
  PIDS+=($!)
  i=$((i + 1))
done
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT TERM INT
t=$(date +%s)
for i in "${!PIDS[@]}"; do
  port=$((PORT0 + i))
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    if ! kill -0 "${PIDS[$i]}" 2>/dev/null || [ $(( $(date +%s) - t )) -gt "${START_S:-120}" ]; then
      echo "server $i did not come up"; tail -n 20 "$OUT/budget_server_$i.log"; break
    fi
    sleep 0.5
  done
done
echo "servers up in $(( $(date +%s) - t ))s"
bench() { local i=$1 name=$2; shift 2
  local port=$((PORT0 + i)) file="$OUT/budget_${name}_$i.json"
  curl -sf "http://127.0.0.1:$port/health" > /dev/null || { echo "=== $name, server $i: not up"; return; }
  echo "=== $name, server $i (flags: '${FLAGS[$i]}') at +$(( $(date +%s) - t ))s"
  $PY -m radixserve.bench_serving --base-url "http://127.0.0.1:$port" --backend radixserve \
    ${TOK:+--tokenizer "$TOK"} --disable-tqdm --output-file "$file" "$@" 2>&1 \
    | grep -E "Successful|Failed|bench_serving:"
  [ -f "$file" ] && $PY - "$file" "${FLAGS[$i]}" "$name" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
d = d.get("summary", d)
r = lambda v: round(v, 2)  # noqa: E731
print("SUMMARY", sys.argv[3], repr(sys.argv[2]), "ok", d["completed"], "dur_s", r(d["duration_s"]), "out_tok_s",
      r(d["output_throughput"]), "ttft_ms med/p99", r(d["ttft_ms"]["median"]), r(d["ttft_ms"]["p99"]),
      "itl_ms med/p90/p99/max", r(d["itl_ms"]["median"]), r(d["itl_ms"]["p90"]), r(d["itl_ms"]["p99"]),
      r(d["itl_ms"]["max"]))
EOF
}
FLAGS=("$@")
for i in "${!PIDS[@]}"; do
  bench "$i" itl --num-prompts "${ITL_N:-96}" --request-rate 16 --random-input-len "${ITL_IN:-1024}" \
    --random-output-len "${ITL_OUT:-256}" --random-range-ratio 1.0 --seed 2
done
if [ "${TTFT_N:-6}" -gt 0 ]; then
  bench 0 ttft --num-prompts "${TTFT_N:-6}" --request-rate 1 --random-input-len "${TTFT_IN:-128}" \
    --random-output-len 16 --random-range-ratio 1.0 --seed 3
fi
for i in "${!PIDS[@]}"; do
  echo "--- server $i: $(grep -i "step token budget\|captured\|KV pool" "$OUT/budget_server_$i.log" | cut -c1-160 \
    | tr '\n' '|' | cut -c1-600)"
done
