#!/usr/bin/env bash
# Everything we measure on the H200 in one run: GPU tests, bench_one_batch on the 8B shape
# with bandwidth utilisation, transformers peers, offline throughput, overlap on/off. Logs and JSON go to $OUT.
# Usage, from the repo root on a CUDA machine:  bash benchmarks/gpu_suite.sh   (with radixserve's dependencies
# installed; wheels placed under .whl/, if any, are installed into /tmp/site first)
# .bench_tok (carried too; ignored by git): a tokenizer for the shape configs, for structured output and its GPU test:
#   mkdir -p .bench_tok && cp ~/.cache/radixserve/*/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .bench_tok/
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ -z "${SKIP_PIP:-}" ] && [ -d .whl ]; then  # SKIP_PIP=1: the wheels are already in /tmp/site (parallel runs on several GPUs)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
L8=radixserve/configs/shapes/llama-3.1-8b
Q05=radixserve/configs/shapes/qwen2.5-0.5b
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
LOGS=${LOGS:-/tmp/radixserve-logs}; mkdir -p "$LOGS"  # logs stay there; only the JSON results go to $OUT
step() { local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi  # ONLY="a b": run just those steps
  echo "=== $name"; local t=$(date +%s)
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t ))s" | tee -a "$LOGS/steps.txt"
  tr '\r' '\n' < "$LOGS/$name.log" | grep -v 'it/s\]\|req/s\]\|tensor/s\]\|s/it\]\|^\s*$' | tail -n 14 | cut -c1-220; }
step one_batch_8b 220 python3 -m radixserve.bench_one_batch --model-path $L8 --load-format dummy \
  --batch-size 1 8 32 64 128 160 --input-len 512 --output-len 32 --profile --result-file "$OUT/one_batch_8b.json"
# the same batches with the decode forward compiled by torch.compile for all six sizes (compile time in its log)
step one_batch_8b_compile 400 python3 -m radixserve.bench_one_batch --model-path $L8 --load-format dummy \
  --batch-size 1 8 32 64 128 160 --input-len 512 --output-len 32 --profile --enable-torch-compile \
  --torch-compile-max-bs 160 --result-file "$OUT/one_batch_8b_compile.json"
step one_batch_8b_unfused 120 env RADIXSERVE_DISABLE_FUSED_KERNELS=1 python3 -m radixserve.bench_one_batch \
  --model-path $L8 --load-format dummy --batch-size 1 64 --input-len 512 --output-len 32 --profile \
  --result-file "$OUT/one_batch_8b_unfused.json"
step hf_generate_bs1 90 python3 benchmarks/peers/hf_peer.py --model-path $L8 --mode generate --batch-size 1 \
  --input-len 512 --output-len 64 --result-file "$OUT/hf_generate_bs1.json"
step offline_subset_ours 120 python3 -m radixserve.bench_offline_throughput --model-path $L8 --load-format dummy \
  --num-prompts 128 --random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5 --fixed-output \
  --log-level warning --result-file "$OUT/offline_subset_ours.json"
step offline_subset_hf 240 python3 benchmarks/peers/hf_peer.py --model-path $L8 --mode generate_batch \
  --num-prompts 128 --random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5 --fixed-output \
  --result-file "$OUT/offline_subset_hf.json"
step offline_full_ours 200 python3 -m radixserve.bench_offline_throughput --model-path $L8 --load-format dummy \
  --num-prompts 1000 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.5 \
  --log-level warning --result-file "$OUT/offline_full_ours.json" ${FULL_ARGS:-}
step offline_full_ours_bs512 200 python3 -m radixserve.bench_offline_throughput --model-path $L8 --load-format dummy \
  --num-prompts 1000 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.5 \
  --log-level warning --result-file "$OUT/offline_full_ours_bs512.json" --cuda-graph-max-bs 512 --max-running-requests 512
# where an offline run's time goes, phase by phase (profile, Python stacks, Triton compiles while serving)
step admission_8b 300 python3 benchmarks/bench_admission.py --model-path $L8 --load-format dummy --max-seconds 90 \
  --log-level warning --out-dir "$OUT" --result-file "$OUT/admission_8b.json"
step overlap_05b 120 python3 benchmarks/bench_overlap.py --model-path $Q05 --batch-size 64 128 \
  --result-file "$OUT/overlap_05b.json"
step host_overhead_05b 120 python3 benchmarks/bench_host_overhead.py --model-path $Q05 --device cuda \
  --batch-size 128 --steps 100 --repeat 1 --profile --result-file "$OUT/host_overhead_05b.json"
step overlap_8b 200 python3 benchmarks/bench_overlap.py --model-path $L8 --batch-size 64 128 --output-len 128 \
  --result-file "$OUT/overlap_8b.json"
# Structured output on the 8B shape (random weights; the grammar forces valid JSON whatever the logits), with a
# carried tokenizer folder (.bench_tok: SmolLM2's tokenizer files; the shape folders hold config.json only).
step structured_8b 200 python3 benchmarks/bench_structured.py --model-path $L8 --tokenizer-path .bench_tok \
  --load-format dummy --device cuda --batch-size 32 --output-len 128 --repeats 2 --output "$OUT/structured_8b.json"
# multi-LoRA: 8 random rank-16 adapters on all seven projections vs the base model, decode and offline
step lora_8b 200 python3 benchmarks/bench_lora.py --model-path $L8 --load-format dummy --num-prompts 192 \
  --decode-steps 16 --result-file "$OUT/bench_lora.json"
step prefix_policy_8b 150 python3 benchmarks/bench_prefix_policy.py --model-path $L8 --load-format dummy \
  --groups 16 --per-group 8 --prefix-len 2048 --question-len 64 --output-len 16 --max-total-tokens 16384 \
  --disable-cuda-graph --result-file "$OUT/prefix_policy_8b.json"
step gpu_tests 480 python3 -m pytest -q tests/gpu tests/test_triton_attention.py tests/test_fused_ops.py \
  tests/test_lora_kernels.py \
  -p no:cacheprovider
echo "=== summary"; cat "$LOGS/steps.txt"
