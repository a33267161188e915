"""GGUF files keep RoPE scaling where transformers' GGUF config reader does not look: llama.cpp's converter writes
Llama 3.x's `llama3` scaling as a `rope_freqs` tensor of per-frequency divisors, and linear / yarn scaling as
`{arch}.rope.scaling.*` metadata. Served from such a file, the model matches the Hugging Face model the file was made
from (float32, greedy and logits, on a prompt past the original context)."""

from __future__ import annotations

import os

import pytest
import torch
from model_utils import hf_greedy, make_runner, make_tiny_model

from radixserve.bench_one_batch import StaticBatch
from radixserve.configs.model_config import ModelConfig
from radixserve.layers.rotary_embedding import FREQ_FACTORS
from radixserve.model_loader.gguf_loader import open_gguf
from radixserve.model_loader.gguf_writer import write_llama_gguf

SCALINGS = {
    "llama3": None,  # make_tiny_model's llama3-rope: factor 8 over an original 64 positions
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_gguf_rope_scaling_matches_the_source_model(kind: str, tmp_path) -> None:
    from safetensors.torch import load_file

    src = os.path.join(tmp_path, "hf")
    if kind == "llama3":
        hf = make_tiny_model("llama3-rope", src, initializer_range=0.08)
    else:
        hf = make_tiny_model("llama", src, initializer_range=0.08, rope_scaling=SCALINGS[kind])
    tensors = {k: v.float() for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    path = os.path.join(tmp_path, "m.gguf")
    written = write_llama_gguf(path, tensors, hf.config, lambda name, shape: None)
    assert ("rope_freqs.weight" in written) == (kind == "llama3")  # as llama.cpp's converter writes Llama 3.x
    scaling = ModelConfig(path).rope_scaling
    assert scaling is not None and scaling["rope_type"] == (FREQ_FACTORS if kind == "llama3" else kind)

    runner = make_runner(path)
    prompt = [(7 * i + 3) % 250 + 2 for i in range(100)]  # past the original context of every scaling
    sb = StaticBatch(runner)
    batch, _ = sb.prefill([prompt])
    ours = sb.last_logits.next_token_logits[0].clone()
    sb.release(batch)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert sb.generate([prompt], 12)[0] == hf_greedy(hf, prompt, 12)


def test_gguf_rope_scaling_it_cannot_reproduce_is_refused(tmp_path) -> None:
    import gguf

    from radixserve.model_loader.gguf_loader import gguf_rope_scaling

    path = os.path.join(tmp_path, "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    w.add_rope_scaling_factor(4.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="longrope"):
        gguf_rope_scaling(open_gguf(path))
