"""Gemma 2 and Gemma 3 (served as text) against transformers in float32 on tiny random models: scaled embeddings,
four norms a layer scaling by (1 + weight), GELU-tanh, query_pre_attn_scalar, sliding and full layers; Gemma 2's
soft-capped attention scores (every backend that takes them) and logits; Gemma 3's q/k norms, per-type rotary bases
(and the global one's linear scaling), head_dim 256 as the real models have, and the multimodal checkpoints' text
weights; through the scheduler with chunked prefill and the prefix cache, and TP=2 over gloo."""

from __future__ import annotations

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, make_tiny_model, scheduler_waves
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
KINDS = {"plain": {}, "scaled": {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
         "head256": {"head_dim": 256, "query_pre_attn_scalar": 256}}


def gemma3(path: str, kind: str = "plain", seed: int = 0, family: str = "gemma3", **over: object) -> torch.nn.Module:
    hf = make_tiny_model(family, path, seed=seed, **{**KINDS[kind], **over})
    with torch.no_grad():  # norms away from 1 + 0 and sharper attention, so that each term shows in the tokens
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(3.0)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("kind,backend", [("plain", "cpu"), ("scaled", "cpu"), ("head256", "cpu"),
                                          ("plain", "torch_native")])
def test_greedy_matches_transformers(kind: str, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = gemma3(str(tmp_path), kind)
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_window_and_norm_offset_change_the_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The cases above could not pass with the window or the norms' + 1 left out."""
    from radixserve.models import gemma

    hf = gemma3(str(tmp_path))
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    hf.config.sliding_window = 10**6
    assert [hf_greedy(hf, p, 12) for p in PROMPTS] != want
    original = gemma.Gemma3ForCausalLM.load_weight

    def without_offset(self, params, name, tensor):  # noqa: ANN001, ANN202
        return original(self, params, name, tensor - 1.0 if name.endswith("norm.weight") else tensor)

    monkeypatch.setattr(gemma.Gemma3ForCausalLM, "load_weight", without_offset)
    assert StaticBatch(make_runner(str(tmp_path))).generate(PROMPTS, 12) != want


@pytest.mark.parametrize("backend", ["cpu", "torch_native", "flex", "triton"])  # triton: interpreted on the CPU
def test_gemma2_greedy_matches_transformers(backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = gemma3(str(tmp_path), family="gemma2")
    steps = 6 if backend in ("triton", "flex") else 12  # the interpreter / eager flex are slow on the CPU
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, steps) == [hf_greedy(hf, p, steps) for p in PROMPTS]


def test_gemma2_soft_caps_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The Gemma 2 cases above could not pass with the attention cap left out."""
    hf = gemma3(str(tmp_path), family="gemma2")
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    for layer in hf.model.layers:  # each attention keeps the config's cap from its construction
        layer.self_attn.attn_logit_softcapping = None
    assert [hf_greedy(hf, p, 12) for p in PROMPTS] != want


def test_gemma2_prompt_logprobs_come_from_capped_logits(tmp_path) -> None:  # noqa: ANN001
    """The final cap leaves the argmax alone (tanh is increasing) but not the distribution: prompt logprobs equal
    transformers' log-softmax of its capped logits, which differ from the uncapped ones."""
    hf = gemma3(str(tmp_path), family="gemma2")
    with torch.no_grad():  # logits well past the cap (1.5), so that capping changes the distribution
        hf.model.norm.weight.add_(20.0)
    hf.save_pretrained(str(tmp_path))
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert float(logits.abs().max()) <= 1.5
    got = StaticBatch(make_runner(str(tmp_path))).prompt_logprobs(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    hf.config.final_logit_softcapping = None
    with torch.no_grad():
        uncapped = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
    assert not torch.allclose(uncapped.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], want, atol=1e-2)


def test_gemma2_refused_by_backends_without_soft_capping(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A backend that does not set supports_logit_cap (flashinfer, double sparsity) is refused at load."""
    from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend

    gemma3(str(tmp_path), family="gemma2")
    monkeypatch.setattr(TorchNativeAttnBackend, "supports_logit_cap", False)
    with pytest.raises(ValueError, match="soft-caps its attention scores .* torch_native attention backend"):
        make_runner(str(tmp_path), attention_backend="torch_native")


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    """Chunks of 5 tokens and prompts sharing cached prefixes longer than the window."""
    hf = gemma3(str(tmp_path), "scaled")
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_multimodal_checkpoint_served_as_text(tmp_path) -> None:  # noqa: ANN001
    """Gemma3ForConditionalGeneration (the 4B-27B checkpoints): the text weights under language_model.*, the vision
    tower skipped; text prompts give transformers' tokens."""
    from transformers import AutoModelForImageTextToText

    from radixserve.configs.model_config import ModelConfig

    gemma3_multimodal(str(tmp_path))
    hf = AutoModelForImageTextToText.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert ModelConfig(str(tmp_path)).architectures == ["Gemma3ForConditionalGeneration"]
    runner = make_runner(str(tmp_path))
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("over,message", [({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
                                          ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
                                          ({"hidden_activation": "silu"}, "hidden_activation"),
                                          ({"use_bidirectional_attention": True}, "bidirectional")])
def test_unsupported_configs_are_refused(over: dict, message: str, tmp_path) -> None:  # noqa: ANN001
    make_tiny_model("gemma3", str(tmp_path), **over)
    with pytest.raises(ValueError, match=message):
        make_runner(str(tmp_path))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path)
    make_tiny_model("gemma3", path, seed=4, initializer_range=INIT_RANGE, **KINDS["scaled"])
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want


def gemma3_multimodal(path: str) -> None:
    """A tiny Gemma3ForConditionalGeneration (a SigLIP tower of 2 layers beside the 2 text layers) saved to `path`."""
    import transformers as tf

    torch.manual_seed(0)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, head_dim=32, query_pre_attn_scalar=24, sliding_window=5,
                sliding_window_pattern=2)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=255,
                          boi_token_index=253, eoi_token_index=254)
    model = tf.Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)


def test_multimodal_lora_serves_its_text_layers(tmp_path) -> None:  # noqa: ANN001
    """PEFT's q_proj / v_proj targets on Gemma3ForConditionalGeneration match the vision tower's layers too, under
    the same layer numbers: served as text, only the language model's LoRA applies (as for text-only input in
    transformers), never the tower's in its place."""
    from lora_utils import make_adapter, peft_greedy
    from safetensors.torch import load_file
    from test_lora import submit_lora
    from test_scheduler import drain, make_scheduler

    path, adapter = str(tmp_path / "base"), str(tmp_path / "adapter")
    gemma3_multimodal(path)
    make_adapter(path, adapter, 4, 8, False, ["q_proj", "v_proj", "o_proj"], seed=3)
    assert any(".vision_tower." in name for name in load_file(f"{adapter}/adapter_model.safetensors"))
    want = peft_greedy(path, adapter, PROMPTS, 8)
    assert want != peft_greedy(path, None, PROMPTS, 8)
    s = make_scheduler(path, lora_paths=[f"mm={adapter}"])
    for i, prompt in enumerate(PROMPTS):
        submit_lora(s, str(i), prompt, 8, "mm")
    res = drain(s)
    assert [res[str(i)]["ids"] for i in range(len(PROMPTS))] == want


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gguf_gemma_files_are_refused(arch: str, tmp_path) -> None:  # noqa: ANN001
    """llama.cpp's Gemma files keep the norms with the 1 added and name the post-norms the loader does not map:
    refused when the config is read, not after half the tensors loaded (transformers reads Gemma 2's config)."""
    import gguf
    import numpy as np

    from radixserve.configs.model_config import ModelConfig

    path = str(tmp_path / f"{arch}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=f"GGUF files of Gemma {arch[-1]}"):
        ModelConfig(path)
