"""Llama 4 against transformers in float32 on tiny random models: rotating layers that attend within chunks and
L2-norm their q/k heads, NoPE layers with query temperature tuning, interleaved rotary (llama3-scaled), MoE layers
(sigmoid router, the score applied to the expert's input, a shared expert) interleaved with dense ones; the
text-only and the multimodal checkpoint (its vision tower skipped); every backend that takes chunks, the scheduler
with chunked prefill and the prefix cache across chunk boundaries, TP=2 over gloo."""

from __future__ import annotations

import json

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
TEXT = dict(hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6,
            num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8,
            floor_scale=4, attn_scale=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            # Scout's llama3 scaling, scaled down
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14, projector_input_dim=32, projector_output_dim=32, vision_output_dim=32,
              pixel_shuffle_ratio=0.5)


def llama4(path: str, seed: int = 0, multimodal: bool = False, save: bool = True, **over: object) -> torch.nn.Module:
    """A tiny Llama 4 (layers 0-2 chunked with rotary, layer 3 NoPE; layers 1 and 3 MoE) with a decisive router and
    sharper attention in the NoPE layer (the rotating layers norm their q/k), where the temperature then shows."""
    import transformers as tf

    torch.manual_seed(seed)
    text = tf.Llama4TextConfig(**{**TEXT, **over})
    if multimodal:
        cfg = tf.Llama4Config(text_config=text.to_dict(), vision_config=VISION, tie_word_embeddings=False)
        hf = tf.Llama4ForConditionalGeneration(cfg).eval()
    else:
        hf = tf.Llama4ForCausalLM(text).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "router" in name:  # a decisive choice of expert
                p.mul_(20.0)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    if save:
        hf.save_pretrained(path)
    return hf


def greedy(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("backend,step", [("cpu", 2), ("torch_native", 1), ("flex", 2), ("triton", 2)])
def test_greedy_matches_transformers(backend: str, step: int, tmp_path) -> None:  # noqa: ANN001
    """step 1: every layer MoE (Scout); 2: dense and MoE alternating (Maverick)."""
    hf = llama4(str(tmp_path), interleave_moe_layer_step=step)
    steps = 6 if backend in ("triton", "flex") else 12  # the interpreter / eager flex are slow on the CPU
    assert greedy(str(tmp_path), steps, attention_backend=backend) == [hf_greedy(hf, p, steps) for p in PROMPTS]


def test_multimodal_checkpoint_serves_its_text_model(tmp_path) -> None:  # noqa: ANN001
    hf = llama4(str(tmp_path), multimodal=True)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == ["Llama4ForConditionalGeneration"]
    assert greedy(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in PROMPTS]


def _edit_config(path: str, **changes: object) -> None:
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)


def test_each_feature_changes_the_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The cases above could not pass with the chunks, the temperature tuning, the q/k norm or the interleaved-rotary
    layout left out (the expert score's place: `test_moe_block_weights_the_expert_input`)."""
    from radixserve.models.llama4 import Llama4ForCausalLM

    path = str(tmp_path)
    hf = llama4(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert greedy(path) == want
    for change in ({"attention_chunk_size": 4096}, {"attn_temperature_tuning": False}, {"use_qk_norm": False}):
        llama4(path)
        _edit_config(path, **change)
        assert greedy(path) != want, change
    llama4(path)
    with monkeypatch.context() as m:
        m.setattr(Llama4ForCausalLM, "_laid_out", lambda self, name, t: t)
        assert greedy(path) != want


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_block_weights_the_expert_input(top_k: int, tmp_path) -> None:  # noqa: ANN001
    """Our MoE block equals transformers' Llama4TextMoe on the same weights: each chosen expert is fed the token
    times its sigmoid score (for top-2 as well, one expert run per choice). Weighting the outputs instead (as the
    other MoE families do) differs by far more than the tolerance; in the greedy tokens of these tiny models it
    mostly does not show (the expert is nearly homogeneous of degree 2 in its input: the two differ by about a
    per-token factor, which the following norms absorb)."""
    path = str(tmp_path)
    hf = llama4(path, num_experts_per_tok=top_k)
    ours = make_runner(path).model.model.layers[1].mlp
    theirs = hf.model.layers[1].feed_forward
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(top_k))
    with torch.no_grad():
        for router in (ours.router, theirs.router):  # scores spread over (0, 1), not all near 1
            router.weight.mul_(0.1)
        for experts in (theirs.experts.gate_up_proj, theirs.experts.down_proj, ours.experts.w13_weight,
                        ours.experts.w2_weight):  # far enough into SiLU's curve
            experts.mul_(5.0)
        got, (want, _) = ours(x), theirs(x)
        on_output = ours.shared_expert(x) + ours.experts.forward(x, ours.router(x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (on_output - want).norm() > 0.1 * want.norm()


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    """5-token prefill chunks and cached prefixes that end inside an 8-token attention chunk."""
    hf = llama4(str(tmp_path), interleave_moe_layer_step=1)
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_dummy_weights_and_rotary_tables(tmp_path) -> None:  # noqa: ANN001
    """--load-format dummy serves the model (the weightless q/k norms stay ones); a 10M-position config builds its
    rotary tables for TABLE_POSITIONS, and the model runner sizes the request table and extends the rotary tables
    to the longest request the KV pool can hold (min(context, pool) + 8 positions), not to the 10M context."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.llama4 import TABLE_POSITIONS, Llama4ForCausalLM

    path = str(tmp_path)
    llama4(path)
    runner = make_runner(path, load_format="dummy")
    assert len(StaticBatch(runner).generate(PROMPTS, 4)[0]) == 4
    norms = [m.q_norm.weight for m in runner.model.modules() if hasattr(m, "q_norm")]
    assert len(norms) == 3 and all(bool((w == 1).all()) for w in norms)
    nope = {id(layer.self_attn.rotary_emb) for layer in runner.model.model.layers if not layer.self_attn.rotates}
    assert len(nope) == 1 and runner.model.model.layers[3].self_attn.rotary_emb.rotary_dim == 0  # one shared table
    _edit_config(path, max_position_embeddings=10_000_000)
    model = Llama4ForCausalLM(ModelConfig(path).hf_config)
    assert model.model.layers[0].self_attn.rotary_emb.cos_cache.shape[0] == TABLE_POSITIONS
    runner = make_runner(path)  # the 10M context, a pool of 4,096 tokens
    assert runner.context_len == 10_000_000 and runner.req_to_token_pool.req_to_token.shape[1] == 4096 + 8
    assert runner.model.model.layers[0].self_attn.rotary_emb.cos_cache.shape[0] == TABLE_POSITIONS
    runner = make_runner(path, max_total_tokens=TABLE_POSITIONS + 100)
    assert runner.req_to_token_pool.req_to_token.shape[1] == TABLE_POSITIONS + 108
    assert runner.model.model.layers[0].self_attn.rotary_emb.cos_cache.shape[0] == TABLE_POSITIONS + 108


def test_bad_configs_quantized_experts_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.llama4 import Llama4ForCausalLM

    path = str(tmp_path)
    llama4(path)
    cfg = ModelConfig(path).hf_config
    model = Llama4ForCausalLM(cfg)
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match="quantized Llama 4 experts"):
        model.load_weight(params, "model.layers.1.feed_forward.experts.gate_up_proj",
                          torch.zeros(4, 64, 128, dtype=torch.float8_e4m3fn))
    cfg.layer_types = ["chunked_attention", "sliding_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        Llama4ForCausalLM(cfg)
    cfg.layer_types, cfg.attention_chunk_size = ["chunked_attention"] + ["full_attention"] * 3, None
    with pytest.raises(ValueError, match="attention_chunk_size"):
        Llama4ForCausalLM(cfg)
    with pytest.raises(ValueError, match="GGUF files of Llama 4 are not supported"):
        ModelConfig(stub_gguf(str(tmp_path / "l4.gguf"), "llama4"))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """Heads split (their chunks and temperatures per position), experts' intermediate slices, the shared expert."""
    path = str(tmp_path)
    llama4(path, seed=4, initializer_range=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want


def test_layout_orders_stay_on_the_cpu_under_a_device_default() -> None:
    """Models are built under the GPU as default device, the checkpoint's tensors arrive on the CPU: the q/k layout
    orders that index them are CPU tensors whatever the default (on an H100 a CUDA order failed to index them)."""
    from radixserve.layers.rotary_embedding import partial_rotary_order
    from radixserve.models.glm4 import rotary_order

    with torch.device("meta"):
        orders = [rotary_order(16, 16, interleaved=True), rotary_order(16, 8, interleaved=True),
                  partial_rotary_order(16, 8)]
    assert all(o.device.type == "cpu" for o in orders)
    assert rotary_order(16, 16, interleaved=True).tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
