"""DBRX against transformers in float32 on tiny random models: the fused Wqkv split at load and clamped by clip_qkv,
bias-free LayerNorms, softmax top-k routing divided by the p-norm of the chosen weights (p = 1, 2, none), the fused
w1 / v1 / w2 experts; the cpu and torch_native backends, the scheduler with chunked prefill and the prefix cache,
TP=2 over gloo (Wqkv split per rank), dummy weights, attn_config.rope_theta and refusals."""

from __future__ import annotations

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
STEPS = 8
THETA = 5000.0


def dbrx(path: str, seed: int = 0, save: bool = True, p: float | None = 1.0, clip: float | None = 0.5,
         **over: object) -> torch.nn.Module:
    """A tiny DBRX (8 experts, top 3; 4 heads, 2 KV heads) whose clip_qkv clamps many q/k/v values. The rotary
    base is given both as attn_config.rope_theta (ours) and rope_parameters (transformers 5's)."""
    import transformers as tf

    cfg = dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=512, vocab_size=256, initializer_range=0.15,
               pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": THETA},
               attn_config={"kv_n_heads": 2, "clip_qkv": clip, "rope_theta": THETA},
               ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 3,
                           "moe_normalize_expert_weights": p})
    torch.manual_seed(seed)
    hf = tf.AutoModelForCausalLM.from_config(tf.DbrxConfig(**{**cfg, **over})).float().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
            if name.endswith("router.layer.weight"):
                param.mul_(3.0)
    if save:
        hf.save_pretrained(path)
    return hf


def greedy(path: str, steps: int = STEPS, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("backend,p", [("cpu", 1.0), ("cpu", 2.0), ("torch_native", None)])
def test_greedy_matches_transformers(backend: str, p: float | None, tmp_path) -> None:  # noqa: ANN001
    hf = dbrx(str(tmp_path), p=p)
    want = [hf_greedy(hf, q, STEPS) for q in PROMPTS]
    assert len({t for w in want for t in w}) > 4
    assert greedy(str(tmp_path), attention_backend=backend) == want


def test_clip_and_p_norm_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass without the clamp, nor with the p-norm 2 routing served as p = 1's."""
    path = str(tmp_path)
    hf = dbrx(path, p=2.0)
    want = [hf_greedy(hf, q, STEPS) for q in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.self_attn.clip = None
    assert StaticBatch(runner).generate(PROMPTS, STEPS) != want
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.mlp.p = None  # the plain top-k weights
    assert StaticBatch(runner).generate(PROMPTS, STEPS) != want


def test_rope_theta_from_attn_config(tmp_path) -> None:  # noqa: ANN001
    """A release-style config (attn_config.rope_theta, no top-level rope_theta) rotates with attn_config's base;
    transformers 5 would take its default 10,000 (the module's note)."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.dbrx import DbrxForCausalLM

    path = str(tmp_path)
    hf = dbrx(path, save=False, rope_parameters=None, attn_config={"kv_n_heads": 2, "rope_theta": 500000.0})
    hf.config.save_pretrained(path)
    assert hf.config.rope_parameters["rope_theta"] == 10000.0
    rotary = DbrxForCausalLM(ModelConfig(path).hf_config).model.layers[0].self_attn.rotary_emb
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    torch.testing.assert_close(rotary.cos_cache[7], (7 * inv_freq).cos())


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = dbrx(str(tmp_path))
    assert scheduler_waves(str(tmp_path), max_new_tokens=STEPS) == [hf_greedy(hf, q, STEPS) for q in WAVE_PROMPTS]


def test_dummy_weights_do_not_depend_on_the_tp_split(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_loader.dummy import initialize_dummy_weights
    from radixserve.models.dbrx import DbrxForCausalLM

    path = str(tmp_path)
    dbrx(path, save=False).config.save_pretrained(path)
    cfg = ModelConfig(path).hf_config
    models = []
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        model = DbrxForCausalLM(cfg, rank, size)
        initialize_dummy_weights(model)
        models.append(dict(model.named_parameters()))
    whole, rank0, rank1 = models
    w2, qkv = "model.layers.1.mlp.experts.w2_weight", "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(torch.cat([rank0[w2], rank1[w2]], 2), whole[w2])
    assert torch.equal(torch.cat([rank0[qkv][:32], rank1[qkv][:32]]), whole[qkv][:64])
    out = greedy(path, 4, load_format="dummy")
    assert [len(o) for o in out] == [4, 4, 4]


def test_bad_configs_tensors_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    from safetensors.torch import load_file, save_file

    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.dbrx import DbrxForCausalLM

    path = str(tmp_path)
    dbrx(path)
    cases = ((("ffn_config", "ffn_act_fn"), {"name": "gelu"}, "ffn_act_fn 'gelu'"),
             (("ffn_config", "moe_normalize_expert_weights"), -1.0, "moe_normalize_expert_weights must be"),
             (("attn_config", "clip_qkv"), 0, "clip_qkv must be"),
             (("attn_config", "rope_theta"), "big", "rope_theta must be"),
             (("tie_word_embeddings",), True, "tie_word_embeddings"))
    for keys, value, match in cases:
        cfg = ModelConfig(path).hf_config
        owner = getattr(cfg, keys[0]) if len(keys) == 2 else cfg
        owner.__dict__[keys[-1]] = value  # past the config class's own checks
        with pytest.raises(ValueError, match=match):
            DbrxForCausalLM(cfg)
    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    w1 = "transformer.blocks.0.ffn.experts.mlp.w1"
    for bad, match in (({w1: tensors[w1][:-1]}, "expected a 256 x 64"),
                       ({"transformer.blocks.0.ffn.experts.mlp.w1_scale": torch.ones(8)}, "unexpected weight")):
        save_file({**tensors, **bad}, file, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match):
            make_runner(path)
    with pytest.raises(ValueError, match="GGUF files of DBRX are not supported"):
        ModelConfig(stub_gguf(str(tmp_path / "dbrx.gguf"), "dbrx"))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """Wqkv split per rank (two q heads and one KV head a rank), clamped on each rank's slice; experts split by
    their intermediate dim."""
    path = str(tmp_path)
    dbrx(path, seed=2)
    got, want = tp2_and_tp1_outputs(path, PROMPTS, max_new_tokens=STEPS)
    assert got == want
