"""Granite MoE (GraniteMoeForCausalLM) and Granite MoE with a shared MLP (GraniteMoeSharedForCausalLM) against
transformers in float32 on tiny random models: Granite's four multipliers, the router (top-k of the logits, softmax
over the chosen), the experts loaded from their fused [E, 2I, H] / [E, H, I] tensors into the stacked layout, the
shared MLP; through the scheduler with chunked prefill and the prefix cache, dummy weights (TP-independent), and
TP=2 over gloo (experts split by their intermediate dim, or whole under --ep-size 2)."""

from __future__ import annotations

import os

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, make_tiny_model, scheduler_waves, stub_gguf
from parallel_utils import tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
KINDS = ("granitemoe", "granitemoeshared")
INIT = 0.5  # wide enough that the tied embeddings (times embedding_multiplier) do not decide every token alone


def granite_moe(kind: str, path: str, **over: object) -> torch.nn.Module:
    return make_tiny_model(kind, path, initializer_range=INIT, **over)


def ours(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("kind,backend", [("granitemoe", "cpu"), ("granitemoe", "torch_native"),
                                          ("granitemoeshared", "cpu"), ("granitemoeshared", "torch_native")])
def test_greedy_matches_transformers(kind: str, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = granite_moe(kind, str(tmp_path))
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert len({t for w in want for t in w}) > 6  # not one token repeated
    assert ours(str(tmp_path), attention_backend=backend) == want


def test_model_structure(tmp_path) -> None:  # noqa: ANN001
    """Tied embeddings; every layer sparse (8 experts of 32, top 2); the shared MLP (48) in the shared class only;
    the multipliers where Granite's dense model puts them."""
    from radixserve.models.granitemoe import GraniteMoeBlock

    for kind in KINDS:
        granite_moe(kind, str(tmp_path / kind))
        model = make_runner(str(tmp_path / kind)).model
        assert model.lm_head is model.model.embed_tokens and model.model.embed_scale == 6.0
        for layer in model.model.layers:
            mlp = layer.mlp
            assert isinstance(mlp, GraniteMoeBlock) and mlp.output_scale == 0.4
            assert mlp.experts.w13_weight.shape == (8, 64, 64) and mlp.experts.router.top_k == 2
            assert layer.self_attn.output_scale == 0.4 and layer.self_attn.attn.scaling == 0.05
            shared = mlp.shared_expert
            assert (shared is None) == (kind == "granitemoe")
            assert shared is None or shared.down_proj.weight.shape == (64, 48)


@pytest.mark.parametrize("name", ["embedding_multiplier", "attention_multiplier", "residual_multiplier"])
def test_each_multiplier_changes_the_tokens(name: str, tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass with any of them left out (logits_scaling keeps the argmax, but not the
    logprobs: test_granite.py)."""
    hf = granite_moe("granitemoeshared", str(tmp_path))
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    granite_moe("granitemoeshared", str(tmp_path / "off"), **{name: 1.0 if name != "attention_multiplier" else 0.25})
    assert ours(str(tmp_path / "off")) != want


def test_shared_mlp_and_routing_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """With softer router scores (the chosen two's softmax far from summing to 1 over all eight) the tokens still
    match, and could not without the shared MLP, nor with the weights left unrenormalised (a softmax over all the
    experts, Mixtral's without renormalisation, in place of the softmax over the chosen logits)."""
    import dataclasses

    path = str(tmp_path)
    hf = granite_moe("granitemoeshared", path)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("router.weight"):
                p.mul_(0.05)  # make_tiny_model sharpens them 40x
    hf.save_pretrained(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert ours(path) == want
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.mlp.shared_expert = None
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        experts = layer.mlp.experts
        experts.router = dataclasses.replace(experts.router, renormalize=False)
    assert StaticBatch(runner).generate(PROMPTS, 12) != want


def test_router_matches_transformers() -> None:
    """select_experts with Granite's RouterConfig gives transformers' router's experts and weights."""
    import transformers as tf
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeTopKRouter

    from radixserve.layers.moe import RouterConfig, select_experts

    router = GraniteMoeTopKRouter(tf.GraniteMoeConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=3))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=g))
        x = torch.randn(64, 16, generator=g)
        logits, want_w, want_ids = router(x)
    w, ids = select_experts(logits, RouterConfig(8, 3, "softmax", renormalize=True))
    order, want_order = ids.long().sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), want_w.gather(1, want_order.indices))


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = granite_moe("granitemoeshared", str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_in_memory_names_load_and_bad_tensors_are_refused(tmp_path) -> None:  # noqa: ANN001
    """transformers 5's in-memory names of the experts and router load as the checkpoint's do; a quantized fused
    expert tensor, a shared MLP in the non-shared class and a stray tensor are refused."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path)
    hf = granite_moe("granitemoeshared", path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    renames = {"block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
               "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
               "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight"}
    renamed = {}
    for name, t in tensors.items():
        for old, new in renames.items():
            name = name.replace(old, new)
        renamed[name] = t
    assert renamed.keys() != tensors.keys()
    save_file(renamed, file, metadata={"format": "pt"})
    assert ours(path) == want
    bad = {"model.layers.0.block_sparse_moe.input_linear.weight_scale": torch.ones(8, 64),
           "model.layers.0.block_sparse_moe.experts.gate_up_proj":
               renamed["model.layers.0.block_sparse_moe.experts.gate_up_proj"].to(torch.float8_e4m3fn),
           "model.layers.0.shared_mlp.gate_proj.weight": torch.ones(48, 64)}
    for name, t in bad.items():
        save_file({**renamed, name: t}, file, metadata={"format": "pt"})
        with pytest.raises(ValueError, match="not supported|unexpected weight"):
            make_runner(path)
    granite_moe("granitemoe", path)
    save_file({**load_file(file), "model.layers.0.shared_mlp.output_linear.weight": torch.ones(64, 48)}, file,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="shared_expert"):
        make_runner(path)


def test_bad_configs_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.granitemoe import GraniteMoeSharedForCausalLM

    path = str(tmp_path)
    granite_moe("granitemoeshared", path)
    for key, value, match in (("shared_intermediate_size", -1, "shared_intermediate_size must be"),
                              ("residual_multiplier", "0.2", "residual_multiplier must be a number"),
                              ("embedding_multiplier", None, "embedding_multiplier must be a number"),
                              ("num_experts_per_tok", 9, "num_experts_per_tok 9 must be in 1..8"),
                              ("partial_rotary_factor", 0.5, "does not support partial_rotary_factor"),
                              ("hidden_act", "gelu", "hidden_act 'gelu' is not supported")):
        cfg = ModelConfig(path).hf_config
        cfg.__dict__[key] = value  # past the config class's own checks
        with pytest.raises(ValueError, match=match):
            GraniteMoeSharedForCausalLM(cfg)
    file = stub_gguf(str(tmp_path / "granitemoe.gguf"), "granitemoe")
    with pytest.raises(ValueError, match="GGUF files of Granite MoE are not supported"):
        ModelConfig(file)


def test_dummy_weights_do_not_depend_on_the_tp_split(tmp_path) -> None:  # noqa: ANN001
    """--load-format dummy draws each fused expert tensor and the shared MLP whole and gives each rank its
    intermediate slice; a dummy-weighted model serves."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_loader.dummy import initialize_dummy_weights
    from radixserve.models.granitemoe import GraniteMoeSharedForCausalLM

    path = str(tmp_path)
    granite_moe("granitemoeshared", path)
    cfg = ModelConfig(path).hf_config
    whole, rank0, rank1 = [], [], []
    for out, (rank, size) in zip((whole, rank0, rank1), ((0, 1), (0, 2), (1, 2)), strict=True):
        model = GraniteMoeSharedForCausalLM(cfg, rank, size)
        initialize_dummy_weights(model)
        out.append(dict(model.named_parameters()))
    whole, rank0, rank1 = whole[0], rank0[0], rank1[0]
    w13, w2 = "model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight"
    halves = [r[w13].chunk(2, dim=1) for r in (rank0, rank1)]
    assert torch.equal(torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]], 1), whole[w13])
    assert torch.equal(torch.cat([rank0[w2], rank1[w2]], 2), whole[w2])
    down = "model.layers.1.mlp.shared_expert.down_proj.weight"
    assert torch.equal(torch.cat([rank0[down], rank1[down]], 1), whole[down])
    out = ours(path, 4, load_format="dummy")
    assert all(len(o) == 4 for o in out) and out == ours(path, 4, load_format="dummy")


@pytest.mark.integration
@pytest.mark.parametrize("kind,ep", [("granitemoe", 1), ("granitemoeshared", 2)])
def test_tp2_matches_tp1(kind: str, ep: int, tmp_path) -> None:  # noqa: ANN001
    """Experts split over the ranks by their intermediate dim, or (--ep-size 2) 4 whole experts a rank from the
    fused tensors; the shared MLP split; one all-reduce, then the residual multiplier."""
    path = str(tmp_path)
    make_tiny_model(kind, path, seed=4, initializer_range=INIT)
    got, want = tp2_and_tp1_outputs(path, PROMPTS, ep_size=ep)
    assert got == want
