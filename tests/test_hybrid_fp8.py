"""Block-wise fp8 checkpoints of the hybrid Qwen models (as the FP8 releases ship them: 128 x 128 blocks with
`weight_scale_inv`, the DeltaNet's b / a projections, the routers and the LM head left in 16 bits), scaled down to
the tiny models: the DeltaNet's q/k/v/z rows land in their sections in whole blocks (Qwen3.5's separate matrices,
Qwen3-Next's grouped by key head), q/k/v are dequantised at load (the partial rotation's layout moves rows across
blocks), and the tokens are transformers' on the dequantised weights."""

from __future__ import annotations

import pytest
import torch
from model_utils import hf_greedy, make_runner, rewrite_checkpoint, set_quantization_config
from test_qwen3_next import PROMPTS, hybrid

from radixserve.bench_one_batch import StaticBatch


def write_block_fp8(path: str, block: int, not_converted: list[str]) -> str:
    """The tiny model at `path` rewritten with every layer's `*proj*.weight` fp8 in `block` x `block` blocks but
    those named in `not_converted`; returns the folder of its dequantised weights (`rewrite_checkpoint`)."""
    from radixserve.layers.quantization.base import name_matches
    from radixserve.layers.quantization.fp8 import dequantize_blocks, quantize_blocks

    def convert(name: str, t: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        module = name.rsplit(".", 1)[0]
        if ".layers." not in name or not name.endswith(".weight") or "proj" not in module.rsplit(".", 1)[-1] \
                or any(name_matches(module, p) for p in not_converted):
            return None
        q, s = quantize_blocks(t.float(), block, block)
        return {name: q, module + ".weight_scale_inv": s}, dequantize_blocks(q, s, block, block)

    deq_dir = rewrite_checkpoint(path, convert)
    set_quantization_config(path, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [block, block], "modules_to_not_convert": not_converted})
    return deq_dir


@pytest.mark.parametrize("kind,ba", [("qwen3_5", ["in_proj_b", "in_proj_a"]), ("qwen3_next", ["in_proj_ba"])])
def test_block_fp8_checkpoint_matches_its_dequantized_weights(kind: str, ba: list[str], tmp_path,
                                                              monkeypatch) -> None:  # noqa: ANN001
    import transformers as tf

    import radixserve.layers.quantization.fp8 as fp8mod

    path = str(tmp_path)
    hybrid(path, kind)
    deq_dir = write_block_fp8(path, 16, ba + ["gate", "shared_expert_gate", "lm_head"])
    monkeypatch.setattr(fp8mod, "SMALL_M", 1 << 30)  # W8A16: the dequantised reference's arithmetic
    runner = make_runner(path)
    layers = runner.model.model.layers
    net, attn = layers[0].linear_attn, layers[3].self_attn
    assert net.in_proj_qkvz.weight.dtype == fp8mod.FP8 and net.out_proj.weight.dtype == fp8mod.FP8
    assert net.in_proj_ba.weight.dtype == torch.float32  # in the ignore list: 16 bits (here the float32 test)
    assert attn.qkv_proj.weight.dtype == torch.float32 and attn.o_proj.weight.dtype == fp8mod.FP8
    hf = tf.AutoModelForCausalLM.from_pretrained(deq_dir, torch_dtype=torch.float32).eval()
    assert StaticBatch(runner).generate(PROMPTS, 8) == [hf_greedy(hf, p, 8) for p in PROMPTS]


def test_blocks_that_split_a_deltanet_section_are_refused(tmp_path) -> None:  # noqa: ANN001
    """Qwen3-Next's grouped q/k/v/z with blocks taller than a key head's q (16 rows): no whole block a section."""
    path = str(tmp_path)
    hybrid(path, "qwen3_next")
    write_block_fp8(path, 32, ["in_proj_ba", "gate", "shared_expert_gate", "lm_head"])
    with pytest.raises(ValueError, match="in whole blocks"):
        make_runner(path)
