"""LoRA on CUDA: CUDA-graph decode with adapters (the per-row grouping is a graph input) and overlap scheduling give
the tokens of eager decode and of transformers + PEFT (float32); the Triton kernels at 8B slice shapes against the
torch reference in bfloat16. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import make_tiny_model  # noqa: E402

from radixserve.lora.adapter import write_random_adapter  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11, 13], [300, 2, 3, 4], [7] * 3 + list(range(100, 140))]
NEW = 12


def run(base: str, lora_paths: list[str], **kw) -> tuple[dict[str, list[int]], bool]:
    from test_scheduler import drain

    from radixserve.managers import io_struct as io
    from radixserve.managers.scheduler import Scheduler
    from radixserve.sampling.sampling_params import SamplingParams
    from radixserve.server_args import ServerArgs

    s = Scheduler(ServerArgs(model_path=base, device="cuda", dtype="float32", max_total_tokens=8192,
                             skip_tokenizer_init=True, cuda_graph_max_bs=32, lora_paths=lora_paths, **kw),
                  port_args={})
    names = [None] + [p.split("=")[0] for p in lora_paths]
    for i, prompt in enumerate(PROMPTS):
        for name in names:
            sp = SamplingParams.from_dict({"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})
            s.process_input_requests([io.TokenizedGenerateReqInput(rid=f"{name}-{i}", input_text=None,
                                                                   input_ids=prompt, sampling_params=sp,
                                                                   lora_id=name)])
    graphs = s.worker.model_runner.cuda_graph_runner is not None
    pool = s.worker.model_runner.lora_manager.pool
    from radixserve.lora import pool as pool_module

    assert (len(pool.stacked) == len(pool.targets)) == bool(pool_module._stacking)
    out = {rid: r["ids"] for rid, r in drain(s).items()}
    return out, graphs


@pytest.fixture
def stacking(request):
    from radixserve.lora.pool import set_lora_stacking

    set_lora_stacking(request.param)
    yield request.param
    set_lora_stacking(None)


@pytest.mark.parametrize("stacking", [False, True], indirect=True, ids=["separate", "stacked"])
def test_cuda_graphs_and_overlap_with_adapters_match_eager_and_peft(tmp_path, stacking) -> None:
    """With the shrink in separate kernels and stacked into the base GEMM (one expand kernel a layer)."""
    import transformers as tf

    base = str(tmp_path / "base")
    make_tiny_model("llama", base, seed=3, vocab_size=512, initializer_range=0.3)  # logits far apart
    cfg = tf.AutoConfig.from_pretrained(base)
    paths = {}
    for i, (rank, targets) in enumerate([(4, ("q_proj", "v_proj")), (8, ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj")),
                                         (16, ("o_proj", "gate_proj", "down_proj", "k_proj"))]):
        paths[f"r{rank}"] = write_random_adapter(str(tmp_path / f"r{rank}"), cfg, rank, targets, seed=i,
                                                 std=0.3, dtype=torch.float32)
    lora_paths = [f"{n}={p}" for n, p in paths.items()]
    graph, used = run(base, lora_paths)  # CUDA graphs and overlap: the defaults on CUDA
    assert used
    eager, _ = run(base, lora_paths, disable_cuda_graph=True, disable_overlap_schedule=True)
    assert graph == eager
    assert len({tuple(graph[f"{n}-0"]) for n in [None, *paths]}) == 4  # every adapter changes the output
    from peft import PeftModel

    for name in [None, *paths]:
        model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, paths[name])
        model = model.eval()
        for i, p in enumerate(PROMPTS):
            with torch.no_grad():
                ref = model.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
            assert graph[f"{name}-{i}"] == ref, (name, i)


@pytest.mark.parametrize("K,out_slices", [(4096, [(0, 4096), (4096, 1024), (5120, 1024)]),
                                          (14336, [(0, 4096)]), (4096, [(0, 14336), (14336, 14336)])])
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_kernels_at_8b_shapes_bf16(K, out_slices, rows) -> None:
    from radixserve.lora.batch_info import LoRABatchInfo, group_rows
    from radixserve.lora.ops import lora_delta_torch
    from radixserve.lora.triton_ops import lora_shrink_expand

    S, R = 8, 16
    g = torch.Generator(device="cuda").manual_seed(rows)
    n_sub, out_total = len(out_slices), sum(n for _, n in out_slices)
    a = (torch.randn(S, n_sub * R, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    b = (torch.randn(S, out_total, R, device="cuda", generator=g) * 0.02).bfloat16()
    slots = torch.randint(-1, S, (rows,), generator=torch.Generator().manual_seed(rows)).tolist()
    packed, groups, max_len = group_rows(slots, None, S)
    x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
    base = torch.randn(rows, out_total, device="cuda", generator=g).bfloat16()
    scal = [2.0] * S
    ref = base.float()
    lora_delta_torch(x.float(), ref, a.float(), b.float(), out_slices,
                     [(s, r.cuda() if isinstance(r, torch.Tensor) else r) for s, r in groups], [R] * S, scal)
    out = base.clone()
    lora_shrink_expand(x, out, a, b, torch.tensor(scal, device="cuda"), out_slices,
                       LoRABatchInfo(S, packed=packed.cuda()).views(), len(groups), max_len)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    from radixserve.lora.triton_ops import lora_expand_stacked

    w = (torch.randn(out_total, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    ref = x.float() @ w.float().T
    lora_delta_torch(x.float(), ref, a.float(), b.float(), out_slices,
                     [(s, r.cuda() if isinstance(r, torch.Tensor) else r) for s, r in groups], [R] * S, scal)
    info = LoRABatchInfo(S, packed=packed.cuda())
    y = x @ torch.cat([w, a.reshape(-1, K)]).T
    stacked = lora_expand_stacked(y, b, torch.tensor(scal, device="cuda"), out_slices, *info.views()[3:],
                                  info.num_rows)
    torch.testing.assert_close(stacked.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("stacking", [True, False], indirect=True, ids=["stacked", "separate"])
def test_serving_compiles_no_lora_kernel(tmp_path, stacking) -> None:
    """The LoRA kernels are compiled at start (every layer kind, small and large batches) and the packed row arrays
    are 16-byte aligned for any row count: prefills of odd and even token counts above and below 128 rows, and
    decode batches inside and above the largest CUDA graph, compile nothing new while serving."""
    import transformers as tf
    from test_scheduler import drain

    from radixserve.lora import triton_ops
    from radixserve.managers import io_struct as io
    from radixserve.managers.scheduler import Scheduler
    from radixserve.sampling.sampling_params import SamplingParams
    from radixserve.server_args import ServerArgs

    base = str(tmp_path / "base")
    make_tiny_model("llama", base, seed=3, vocab_size=512)
    cfg = tf.AutoConfig.from_pretrained(base)
    paths = [f"a{i}=" + write_random_adapter(str(tmp_path / f"a{i}"), cfg, 8, seed=i, dtype=torch.bfloat16)
             for i in range(3)]
    s = Scheduler(ServerArgs(model_path=base, device="cuda", dtype="bfloat16", max_total_tokens=16384,
                             skip_tokenizer_init=True, cuda_graph_max_bs=8, lora_paths=paths), port_args={})
    kernels = (triton_ops._expand_stacked_kernel, triton_ops._shrink_kernel, triton_ops._expand_kernel)

    def compiled() -> int:  # kernels Triton holds compiled in this process (one per specialisation)
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    before = compiled()
    assert before > 0  # compiled at start
    g = torch.Generator().manual_seed(0)
    for wave, (n, lengths) in enumerate([(3, (5, 131)), (5, (64, 200)), (13, (7, 9)), (1, (257, 257))]):
        for i in range(n):
            length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
            sp = SamplingParams.from_dict({"max_new_tokens": 3 + i % 2, "temperature": 0, "ignore_eos": True})
            s.process_input_requests([io.TokenizedGenerateReqInput(
                rid=f"{wave}-{i}", input_text=None, input_ids=torch.randint(0, 512, (length,), generator=g).tolist(),
                sampling_params=sp, lora_id=[None, "a0", "a1", "a2"][i % 4])])
        assert len(drain(s)) == n
    assert compiled() == before
