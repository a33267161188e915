#!/usr/bin/env bash
# Quantized serving on one H200 in one run: the GPU tests of the quantized kernels, then the 8B-shape benchmarks
# (dummy weights quantised online): decode at batch 1/64/160 for bf16, fp8, fp8 + fp8 KV; Q4_K at batch 1; offline
# throughput bf16 vs fp8 + fp8 KV. JSON to $OUT, a table last.  Usage: OUT=out bash benchmarks/quant_gpu_suite.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
L8=radixserve/configs/shapes/llama-3.1-8b
NP=${NP:-1000}; OLEN=${OLEN:-1024}
LOGS=${LOGS:-/tmp/quant-logs}; mkdir -p "$LOGS"
step() { local name=$1 limit=$2; shift 2
  echo "=== $name"; local t=$(date +%s)
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t ))s" | tee -a "$LOGS/steps.txt"
  tr '\r' '\n' < "$LOGS/$name.log" | grep -v 'it/s\]\|req/s\]\|tensor/s\]\|s/it\]\|^\s*$' | tail -n 6 | cut -c1-200; }
step gpu_tests ${TTIME:-80} python3 -m pytest -q -x tests/gpu/test_quant_gpu.py -p no:cacheprovider
for c in bf16 fp8 fp8_fp8kv; do
  step "one_$c" ${BTIME:-60} python3 benchmarks/bench_quant_gpu.py --config "$c" --batch-size 1 64 160 --result-file "$OUT/quant_$c.json"
done
step one_q4_k ${QTIME:-40} python3 benchmarks/bench_quant_gpu.py --config q4_k --batch-size 1 --result-file "$OUT/quant_q4_k.json"
step offline_bf16 ${OTIME:-60} python3 -m radixserve.bench_offline_throughput --model-path $L8 --load-format dummy \
  --num-prompts $NP --random-input-len 1024 --random-output-len $OLEN --random-range-ratio 0.5 --log-level warning \
  --result-file "$OUT/offline_bf16.json"
step offline_fp8_fp8kv ${OTIME:-60} python3 -m radixserve.bench_offline_throughput --model-path $L8 --load-format dummy \
  --num-prompts $NP --random-input-len 1024 --random-output-len $OLEN --random-range-ratio 0.5 --log-level warning \
  --quantization fp8 --kv-cache-dtype fp8_e4m3 --result-file "$OUT/offline_fp8_fp8kv.json"
echo "=== summary"; cat "$LOGS/steps.txt"
python3 benchmarks/bench_quant_gpu.py --summarize "$OUT"
for f in "$LOGS"/*.log; do echo "##### $f"; tr '\r' '\n' < "$f" | tail -n 60; done > "$OUT/logs.txt" 2>/dev/null; true
