#!/usr/bin/env bash
# The multi-GPU measurements on 2 GPUs (2 x H200) in one run. Steps, in order (ONLY="a b" runs just those):
#   allreduce          all-reduce latency, NCCL vs the symmetric-memory one/two-shot, 8 KiB-4 MiB  bench_all_reduce.py
#   agree_fp32_8b      TP=2 vs TP=1 greedy, float32, 8B dummy, 64 prompts x 128 tokens (>= 99.5%)  tp_agreement.py
#   agree_fp32_small   the same on the Qwen2.5-0.5B shape
#   agree_bf16_8b      the same in bf16 (teacher-forced agreement beside the float32 figure)
#   one_batch_8b_tp1 / one_batch_8b_tp2 / one_batch_8b_tp2_nccl   8B decode, batch 1 and 32 (custom all-reduce,
#                      then NCCL only)                                                           bench_one_batch
#   one_batch_8b_tp2_push / one_batch_8b_tp2_push_pf   the same with the push one-shot (RADIXSERVE_ONE_SHOT=push),
#                      then also asking the L2 for the next weight (RADIXSERVE_AR_PREFETCH_MB=16)
#   one_batch_70b_tp2  70B shape at TP 2, batch 1 and 32 (bandwidth utilisation of both GPUs)
#   offline_tp1_dp2 / offline_tp2   the 1000-prompt 8B offline workload (NOFF prompts, in/out 512-1024)
#   dp_prefix_round_robin / dp_prefix_cache_aware   DP=2 on 32 shared 2,048-token prefixes
#   dsv2_tp2 / dsv2_dpattn / dsv2_tp2_ep / dsv2_dpattn_ep   DeepSeek-V2-Lite offline: plain TP=2, DP attention,
#                      expert parallelism, both                                                 bench_offline_throughput
#   qwen3moe_tp2 / qwen3moe_tp2_ep   Qwen3-30B-A3B offline: plain TP=2 vs expert parallelism
# Results: $OUT/multi_gpu_results.json (every step's JSON merged plus the derived ratios), $OUT/summary.txt,
# $OUT/logs.tgz. Each step has its own timeout and the whole run a deadline (BUDGET seconds): a step that would
# pass it is cut short or skipped, never the summary.
# Usage, from the repo root on a 2-GPU CUDA machine:  BUDGET=1500 bash benchmarks/multi_gpu_suite.sh
# (wheels under .whl/, if any, are installed into /tmp/site first). CPU dry run with tiny models: see the end.
set -u
START=$(date +%s)
BUDGET=${BUDGET:-1500}
OUT=${OUT:-out}; mkdir -p "$OUT"
PY=${PY:-python3}
if [ -z "${SKIP_PIP:-}" ] && [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} || exit 1
else
  export PYTHONPATH=.:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# leave NVLink multicast (NVLS) off everywhere: NCCL, PyTorch's symmetric memory, NVSHMEM
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
S=radixserve/configs/shapes
M8=${M8:-$S/llama-3.1-8b}
M70=${M70:-$S/llama-3.1-70b}
MSMALL=${MSMALL:-$S/qwen2.5-0.5b}
MDS=${MDS:-$S/deepseek-v2-lite}
MQM=${MQM:-$S/qwen3-30b-a3b}
NOFF=${NOFF:-1000}                   # prompts of the 8B offline workload
NMOE=${NMOE:-400}                    # prompts of the MoE offline workloads
EXTRA=${EXTRA:-}                     # appended to every command (the CPU dry run passes --device cpu)
SMALL=${SMALL:-}                     # tiny sizes for a dry run
sz() { if [ -n "$SMALL" ]; then echo "$2"; else echo "$1"; fi; }
LOGS=${LOGS:-/tmp/radixserve-multi}; rm -rf "$LOGS"; mkdir -p "$LOGS/json"
J=$LOGS/json
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  && nvidia-smi topo -m 2>/dev/null | head -4
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
  tr '\r' '\n' < "$LOGS/$name.log" | grep -v 'it/s\]\|req/s\]\|tensor/s\]\|s/it\]\|^\s*$\|Capturing\|Warning: \|warnings.warn\|UserWarning' \
    | tail -n "${TAIL:-10}" | cut -c1-200
  gpu_idle; }

# all-reduce latency (~20 s)
step allreduce 60 $PY benchmarks/bench_all_reduce.py --world-size 2 --sizes-kib 8 16 32 64 128 256 512 1024 4096 \
  --methods nccl one_shot two_shot triton push triton_fused push_fused push_fused_pf auto \
  --result-file "$J/allreduce.json" ${SMALL:+--device cpu --eager-iters 3}
# TP=2 == TP=1 (float32: the free-running greedy tokens; bf16: teacher-forced beside it)
# prompts up to 256 tokens (float32 prefill runs on the CUDA cores: 1024-token prompts made the 8B's two engines
# need minutes); no prefill graphs (a 0.5B float32 TP=1 engine was still capturing them when its 29 s slot ended)
AG=(--load-format dummy --tp-sizes 1 2 --num-prompts "$(sz 64 6)" --max-input-len "$(sz 256 40)"
    --output-len "$(sz 128 12)" --cuda-graph-max-bs "$(sz 64 8)" --prefill-cuda-graph-max-tokens 0 --log-level warning)
step agree_fp32_8b 200 $PY benchmarks/tp_agreement.py --model-path "$M8" "${AG[@]}" --dtype float32 \
  --min-free-agreement 0.995 --result-file "$J/agree_fp32_8b.json" $EXTRA
step agree_fp32_small 120 $PY benchmarks/tp_agreement.py --model-path "$MSMALL" "${AG[@]}" --dtype float32 \
  --min-free-agreement 0.995 --result-file "$J/agree_fp32_small.json" $EXTRA
step agree_bf16_8b 150 $PY benchmarks/tp_agreement.py --model-path "$M8" "${AG[@]}" \
  --result-file "$J/agree_bf16_8b.json" $EXTRA
# 8B decode at batch 1 and 32, TP 1 and 2 (~25 s each); 70B at TP 2 (~60 s)
OB=(--load-format dummy --batch-size 1 "$(sz 32 3)" --input-len "$(sz 512 16)" --output-len "$(sz 64 6)"
    --cuda-graph-max-bs "$(sz 32 4)" --log-level warning)
step one_batch_8b_tp1 70 $PY -m radixserve.bench_one_batch --model-path "$M8" "${OB[@]}" --tp-size 1 \
  --result-file "$J/one_batch_8b_tp1.json" $EXTRA
step one_batch_8b_tp2 80 $PY -m radixserve.bench_one_batch --model-path "$M8" "${OB[@]}" --tp-size 2 \
  --result-file "$J/one_batch_8b_tp2.json" $EXTRA
step one_batch_8b_tp2_push 80 env RADIXSERVE_ONE_SHOT=push $PY -m radixserve.bench_one_batch --model-path "$M8" \
  "${OB[@]}" --tp-size 2 --result-file "$J/one_batch_8b_tp2_push.json" $EXTRA
step one_batch_8b_tp2_push_pf 80 env RADIXSERVE_ONE_SHOT=push RADIXSERVE_AR_PREFETCH_MB=16 $PY -m radixserve.bench_one_batch \
  --model-path "$M8" "${OB[@]}" --tp-size 2 --result-file "$J/one_batch_8b_tp2_push_pf.json" $EXTRA
step one_batch_8b_tp2_nccl 80 $PY -m radixserve.bench_one_batch --model-path "$M8" "${OB[@]}" --tp-size 2 \
  --disable-custom-all-reduce --result-file "$J/one_batch_8b_tp2_nccl.json" $EXTRA
step one_batch_70b_tp2 150 $PY -m radixserve.bench_one_batch --model-path "$M70" "${OB[@]}" --tp-size 2 \
  --context-length 4096 --mem-fraction-static 0.9 --max-total-tokens "$(sz 65536 2048)" \
  --result-file "$J/one_batch_70b_tp2.json" $EXTRA
# the 1000-prompt offline workload: TP1 x DP2 vs TP2
OFF=(--model-path "$M8" --load-format dummy --num-prompts "$(sz "$NOFF" 16)" --random-input-len "$(sz 1024 48)"
     --random-output-len "$(sz 1024 12)" --random-range-ratio 0.5 --log-level warning)
step offline_tp1_dp2 150 $PY -m radixserve.bench_offline_throughput "${OFF[@]}" --dp-size 2 \
  --result-file "$J/offline_tp1_dp2.json" $EXTRA
step offline_tp2 150 $PY -m radixserve.bench_offline_throughput "${OFF[@]}" --tp-size 2 \
  --result-file "$J/offline_tp2.json" $EXTRA
# DP=2 on 32 long shared prefixes, round_robin vs cache_aware (~45 s each)
DPP=(--model-path "$M8" --load-format dummy --dp-size 2 --dataset shared-prefix --num-prompts "$(sz 512 32)"
     --num-groups "$(sz 32 4)" --prefix-len "$(sz 2048 64)" --suffix-len "$(sz 64 8)" --random-output-len "$(sz 64 4)"
     --log-level warning)
step dp_prefix_round_robin 90 $PY -m radixserve.bench_offline_throughput "${DPP[@]}" --load-balance-method round_robin \
  --result-file "$J/dp_prefix_round_robin.json" $EXTRA
step dp_prefix_cache_aware 90 $PY -m radixserve.bench_offline_throughput "${DPP[@]}" --load-balance-method cache_aware \
  --result-file "$J/dp_prefix_cache_aware.json" $EXTRA
# MoE / MLA: DeepSeek-V2-Lite plain TP=2 vs DP attention vs expert parallelism; Qwen3-30B-A3B TP=2 vs EP=2
MOE=(--load-format dummy --num-prompts "$(sz "$NMOE" 12)" --random-input-len "$(sz 1024 48)"
     --random-output-len "$(sz 512 12)" --random-range-ratio 0.5 --log-level warning)
[ -z "$SMALL" ] && MOE+=(--context-length 4096)
step dsv2_tp2 150 $PY -m radixserve.bench_offline_throughput --model-path "$MDS" "${MOE[@]}" --tp-size 2 \
  --result-file "$J/dsv2_tp2.json" $EXTRA
step dsv2_dpattn 150 $PY -m radixserve.bench_offline_throughput --model-path "$MDS" "${MOE[@]}" --tp-size 2 \
  --dp-size 2 --enable-dp-attention --result-file "$J/dsv2_dpattn.json" $EXTRA
step dsv2_tp2_ep 150 $PY -m radixserve.bench_offline_throughput --model-path "$MDS" "${MOE[@]}" --tp-size 2 \
  --ep-size 2 --result-file "$J/dsv2_tp2_ep.json" $EXTRA
step dsv2_dpattn_ep 150 $PY -m radixserve.bench_offline_throughput --model-path "$MDS" "${MOE[@]}" --tp-size 2 \
  --dp-size 2 --enable-dp-attention --ep-size 2 --result-file "$J/dsv2_dpattn_ep.json" $EXTRA
step qwen3moe_tp2 150 $PY -m radixserve.bench_offline_throughput --model-path "$MQM" "${MOE[@]}" --tp-size 2 \
  --result-file "$J/qwen3moe_tp2.json" $EXTRA
step qwen3moe_tp2_ep 150 $PY -m radixserve.bench_offline_throughput --model-path "$MQM" "${MOE[@]}" --tp-size 2 \
  --ep-size 2 --result-file "$J/qwen3moe_tp2_ep.json" $EXTRA

$PY benchmarks/multi_gpu_summary.py --json-dir "$J" --steps "$LOGS/steps.txt" --out "$OUT/multi_gpu_results.json" \
  | tee "$OUT/summary.txt"
tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
echo "total $(( $(date +%s) - START ))s"

# CPU dry run (gloo, tiny models; several minutes on 2 cores):
#   .venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); from parallel_utils import make_model; \
#     make_model('llama', '/tmp/tiny_llama_tp', seed=1); make_model('deepseek_v2_lora', '/tmp/tiny_ds', seed=5); \
#     make_model('qwen3_moe', '/tmp/tiny_qmoe', seed=4)"
#   SKIP_PIP=1 PY=.venv/bin/python SMALL=1 M8=/tmp/tiny_llama_tp M70=/tmp/tiny_llama_tp MSMALL=/tmp/tiny_llama_tp \
#     MDS=/tmp/tiny_ds MQM=/tmp/tiny_qmoe EXTRA="--device cpu" OUT=/tmp/multi-out BUDGET=3000 \
#     bash benchmarks/multi_gpu_suite.sh
