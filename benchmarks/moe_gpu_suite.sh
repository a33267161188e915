#!/usr/bin/env bash
# The MoE / MLA measurements on one H200 in one short run: GPU tests, then bench_moe (decode with bandwidth
# utilisation on active bytes) for Qwen3-30B-A3B and DeepSeek-V2-Lite, then an offline run. Dummy weights from the
# shape configs. Usage (CUDA machine, repo root): bash benchmarks/moe_gpu_suite.sh (wheels under .whl/, if any, are
# installed into /tmp/site first)
# OFF_N: offline prompts (default 1000, the target's workload; OFF_ARGS: more engine flags; the bound is printed
# after each run, for OFF_BATCH requests decoding at once); PEER=1: the first PEER_N prompts (default 16, output
# PEER_OUT = 256 each) timed through the same engine before the whole workload, then through transformers, and the
# ratio, both models; WITH_MIXTRAL=1: Mixtral-8x7B at batch 1 and 32; ONLY="a b": those steps.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ -z "${SKIP_PIP:-}" ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
Q3=radixserve/configs/shapes/qwen3-30b-a3b
DS=radixserve/configs/shapes/deepseek-v2-lite
MX=radixserve/configs/shapes/mixtral-8x7b
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
LOGS="$OUT"
step() { local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  echo "=== $name"; local t=$(date +%s)
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t ))s" | tee -a "$LOGS/steps.txt"
  tr '\r' '\n' < "$LOGS/$name.log" | grep -v 'it/s\]\|req/s\]\|tensor/s\]\|s/it\]\|^\s*$' | tail -n 12 | cut -c1-200; }
step gpu_tests ${T_TESTS:-100} python3 -m pytest -q tests/gpu/test_moe_mla_gpu.py tests/test_triton_mla.py \
  tests/test_fused_moe.py tests/test_small_batch_moe.py tests/test_mla_prep.py tests/test_decode_gemv.py -p no:cacheprovider
step moe_qwen3_30b ${T_Q3:-110} python3 benchmarks/bench_moe.py --model-path $Q3 --load-format dummy \
  --context-length 4096 --batch-size 1 8 32 128 --input-len 512 --output-len 32 --log-level warning \
  --result-file "$OUT/moe_qwen3_30b.json"
step moe_dsv2_lite ${T_DS:-90} python3 benchmarks/bench_moe.py --model-path $DS --load-format dummy \
  --context-length 4096 --batch-size 1 8 32 128 --input-len 512 --output-len 32 --log-level warning \
  --result-file "$OUT/moe_dsv2_lite.json"
SUBSET=""  # PEER: the first PEER_N prompts (output PEER_OUT each) timed through the same engine first
[ -n "${PEER:-}" ] && SUBSET="--subset-prompts ${PEER_N:-16} --subset-output-len ${PEER_OUT:-256}"
for m in qwen3_30b:$Q3 dsv2_lite:$DS; do name=${m%%:*}; path=${m#*:}
  step offline_$name ${T_OFF:-240} python3 -m radixserve.bench_offline_throughput --model-path $path \
    --load-format dummy --context-length 4096 --num-prompts ${OFF_N:-1000} --random-input-len 1024 \
    --random-output-len 1024 --random-range-ratio 0.5 --log-level warning $SUBSET ${OFF_ARGS:-} \
    --result-file "$OUT/offline_$name.json"
  [ -f "$OUT/offline_$name.json" ] && python3 benchmarks/moe_offline_bound.py --model-path $path \
    --offline-json "$OUT/offline_$name.json" --batch ${OFF_BATCH:-512} ${BOUND_ARGS:-}
done
if [ -n "${PEER:-}" ]; then  # transformers on the same subset (DeepSeek: static batches, its paged path lacks MLA)
  for m in qwen3_30b:$Q3:generate_batch dsv2_lite:$DS:static_batch; do
    name=${m%%:*}; rest=${m#*:}; path=${rest%%:*}; mode=${rest#*:}
    step subset_${name}_hf ${T_PEER:-120} python3 benchmarks/peers/hf_peer.py --model-path $path --mode $mode \
      --num-prompts ${PEER_N:-16} --random-input-len 1024 --random-output-len ${PEER_OUT:-256} \
      --random-range-ratio 0.5 --fixed-output --result-file "$OUT/subset_${name}_hf.json"
    [ -f "$OUT/subset_${name}_hf.json" ] && [ -f "$OUT/offline_$name.json" ] && python3 -c "
import json; ours = next(r for r in json.load(open('$OUT/offline_$name.json'))['results']
                         if r['engine'] == 'radixserve_subset')
hf = json.load(open('$OUT/subset_${name}_hf.json'))
print(f\"$name subset: radixserve {ours['output_tok_s']:.0f} / transformers ({hf['mode']}) \"
      f\"{hf['output_tok_s']:.0f} output tok/s = {ours['output_tok_s'] / hf['output_tok_s']:.1f}x\")"
  done
fi
if [ -n "${WITH_MIXTRAL:-}" ]; then
  step moe_mixtral ${T_MX:-120} python3 benchmarks/bench_moe.py --model-path $MX --load-format dummy \
    --context-length 4096 --batch-size 1 32 --input-len 512 --output-len 16 --log-level warning \
    --result-file "$OUT/moe_mixtral.json"
fi
echo "=== summary"; cat "$LOGS/steps.txt"
for f in moe_qwen3_30b moe_dsv2_lite moe_mixtral offline_qwen3_30b offline_dsv2_lite subset_qwen3_30b_hf \
    subset_dsv2_lite_hf; do
  [ -f "$LOGS/$f.log" ] && { echo "--- $f"; grep -A8 'weights .* GB, copy\|^engine\|tok/s' "$LOGS/$f.log" | tail -n 9; }
done
