#!/usr/bin/env bash
# The multi-GPU measurements in one run on 2 GPUs (2 x H200), in at most ~9 minutes of wall time:
#   1. TP=2 vs TP=1 greedy agreement (8B dummy, bf16, CUDA graphs + overlap on)        benchmarks/tp_agreement.py
#   2. 8B batch-1/32 decode at TP 1 and 2; 70B at TP 2 (batch 1 and 32)               bench_one_batch --tp-size
#      offline throughput TP1 x DP2 vs TP2 (400 prompts <=1024 in / <=512 out)          bench_offline_throughput
#   3. DP=2 on a shared-prefix workload: cache_aware vs round_robin (throughput, hit rate)
# Results: $OUT/multi_gpu_results.json (every step's JSON merged, plus the derived ratios), $OUT/summary.txt,
# $OUT/logs.tgz (all logs). Logs also stay in $LOGS. Each step has its own timeout and the whole run a deadline
# (BUDGET seconds, default 510): a step that would pass it is cut short or skipped, never the summary.
# Usage, from the repo root on a multi-GPU CUDA machine:  bash benchmarks/multi_gpu_suite.sh (wheels under .whl/, if
# any, are installed into /tmp/site first)
# ONLY="a b" runs just those steps. CPU dry run with a tiny model (see the end of this file).
set -u
START=$(date +%s)
BUDGET=${BUDGET:-510}
OUT=${OUT:-out}; mkdir -p "$OUT"
PY=${PY:-python3}
if [ -z "${SKIP_PIP:-}" ] && [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} || exit 1
else
  export PYTHONPATH=.:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0            # leave NVLink multicast (NVLS) off
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
M8=${M8:-radixserve/configs/shapes/llama-3.1-8b}
M70=${M70:-radixserve/configs/shapes/llama-3.1-70b}
EXTRA=${EXTRA:-}                     # appended to every command (the CPU dry run passes --device cpu)
SMALL=${SMALL:-}                     # tiny sizes for a dry run
sz() { if [ -n "$SMALL" ]; then echo "$2"; else echo "$1"; fi; }
LOGS=${LOGS:-/tmp/radixserve-multi}; rm -rf "$LOGS"; mkdir -p "$LOGS/json"
J=$LOGS/json
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"

gpu_idle() {  # wait (max 20 s) until no process holds a GPU, so one step's leftovers never starve the next
  command -v nvidia-smi >/dev/null || return 0
  for _ in $(seq 20); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0; sleep 1
  done
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    echo "killing leftover GPU process $pid"; kill -9 "$pid" 2>/dev/null; done; sleep 2
}
step() { local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local left=$(( START + BUDGET - $(date +%s) - 35 ))   # kept: the kill grace, gpu_idle, the summary
  if [ "$left" -lt 30 ]; then echo "$name skipped (out of time budget)" | tee -a "$LOGS/steps.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s, $(( $(date +%s) - START ))s elapsed)"; local t=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t ))s" | tee -a "$LOGS/steps.txt"
  tr '\r' '\n' < "$LOGS/$name.log" | grep -v 'it/s\]\|req/s\]\|tensor/s\]\|s/it\]\|^\s*$\|Capturing\|Warning: \|warnings.warn' \
    | tail -n 10 | cut -c1-200
  gpu_idle; }

# 1. TP=2 == TP=1 (~70 s: two 8B engine starts + 64 mixed requests twice)
step tp_agreement 130 $PY benchmarks/tp_agreement.py --model-path "$M8" --load-format dummy --tp-sizes 1 2 \
  --num-prompts "$(sz 64 8)" --max-input-len "$(sz 1024 48)" --max-output-len "$(sz 64 12)" \
  --cuda-graph-max-bs "$(sz 64 8)" --log-level warning --result-file "$J/tp_agreement.json" $EXTRA
# 2. scaling: 8B batch 1 and 32 decode at TP 1 and 2 (~25 s and ~35 s)
OB=(--load-format dummy --batch-size 1 "$(sz 32 3)" --input-len "$(sz 512 16)" --output-len "$(sz 64 6)"
    --cuda-graph-max-bs "$(sz 32 4)" --log-level warning)
step one_batch_8b_tp1 70 $PY -m radixserve.bench_one_batch --model-path "$M8" "${OB[@]}" --tp-size 1 \
  --result-file "$J/one_batch_8b_tp1.json" $EXTRA
step one_batch_8b_tp2 80 $PY -m radixserve.bench_one_batch --model-path "$M8" "${OB[@]}" --tp-size 2 \
  --result-file "$J/one_batch_8b_tp2.json" $EXTRA
# 70B at TP 2 (141 GB of bf16 weights over 2 x 141 GB; a 64K-token KV pool) (~60 s)
step one_batch_70b_tp2 120 $PY -m radixserve.bench_one_batch --model-path "$M70" "${OB[@]}" --tp-size 2 \
  --context-length 4096 --mem-fraction-static 0.9 --max-total-tokens "$(sz 65536 2048)" \
  --result-file "$J/one_batch_70b_tp2.json" $EXTRA
# 3. DP=2 on 32 long shared prefixes, round_robin vs cache_aware (~45 s each)
DPP=(--model-path "$M8" --load-format dummy --dp-size 2 --dataset shared-prefix --num-prompts "$(sz 512 32)"
     --num-groups "$(sz 32 4)" --prefix-len "$(sz 2048 64)" --suffix-len "$(sz 64 8)" --random-output-len "$(sz 64 4)"
     --log-level warning)
step dp_prefix_round_robin 90 $PY -m radixserve.bench_offline_throughput "${DPP[@]}" --load-balance-method round_robin \
  --result-file "$J/dp_prefix_round_robin.json" $EXTRA
step dp_prefix_cache_aware 90 $PY -m radixserve.bench_offline_throughput "${DPP[@]}" --load-balance-method cache_aware \
  --result-file "$J/dp_prefix_cache_aware.json" $EXTRA
# 2b. offline throughput, TP1 x DP2 vs TP2, on the same 400 random prompts (~55 s each)
OFF=(--model-path "$M8" --load-format dummy --num-prompts "$(sz 400 16)" --random-input-len "$(sz 1024 48)"
     --random-output-len "$(sz 512 12)" --random-range-ratio 0.5 --log-level warning)
step offline_tp1_dp2 100 $PY -m radixserve.bench_offline_throughput "${OFF[@]}" --dp-size 2 \
  --result-file "$J/offline_tp1_dp2.json" $EXTRA
step offline_tp2 100 $PY -m radixserve.bench_offline_throughput "${OFF[@]}" --tp-size 2 \
  --result-file "$J/offline_tp2.json" $EXTRA

$PY benchmarks/multi_gpu_summary.py --json-dir "$J" --steps "$LOGS/steps.txt" --out "$OUT/multi_gpu_results.json" \
  | tee "$OUT/summary.txt"
tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
echo "total $(( $(date +%s) - START ))s"

# CPU dry run (gloo, tiny model; a few minutes on 2 cores):
#   .venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); from parallel_utils import make_model; \
#     make_model('llama', '/tmp/tiny_llama_tp', seed=1)"
#   SKIP_PIP=1 PY=.venv/bin/python SMALL=1 M8=/tmp/tiny_llama_tp M70=/tmp/tiny_llama_tp EXTRA="--device cpu" \
#     OUT=/tmp/multi-out BUDGET=900 bash benchmarks/multi_gpu_suite.sh
