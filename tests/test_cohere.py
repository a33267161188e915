"""Command-R (CohereForCausalLM) and Command-R7B / Command-A (Cohere2ForCausalLM) against transformers in float32 on
tiny random models: the bias-free LayerNorm, attention and MLP in parallel from it, interleaved rotary laid out at
load, logit_scale, tied embeddings, Command-R's per-head q/k LayerNorm (with q/k/v/o biases), Cohere2's sliding
layers and its unrotated (NoPE) full-attention layers; through the scheduler with chunked prefill and the prefix
cache, and TP=2 over gloo. Each term is shown to change the tokens (for logit_scale, the logprobs), so the matches
could fail; Cohere GGUF files are refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, make_tiny_model, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
CASES = {"cohere": {}, "cohere_qk": {"use_qk_norm": True, "attention_bias": True}, "cohere2": {"num_hidden_layers": 4}}


def cohere(case: str, path: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model of `case` whose tokens depend on each term: norms away from 1, sharper attention."""
    kind = "cohere2" if case == "cohere2" else "cohere"
    hf = make_tiny_model(kind, path, seed=seed, initializer_range=0.2, **CASES[case])
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(3.0)
    hf.save_pretrained(path)
    return hf


def ours(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("case,backend", [("cohere", "cpu"), ("cohere", "torch_native"), ("cohere_qk", "cpu"),
                                          ("cohere_qk", "torch_native"), ("cohere2", "cpu"),
                                          ("cohere2", "torch_native")])
def test_greedy_matches_transformers(case: str, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = cohere(case, str(tmp_path))
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    if case == "cohere2":
        assert runner.model_config.sliding_windows == [5, -1, 5, -1]
        assert [layer.self_attn.rotary_emb.rotary_dim for layer in runner.model.model.layers] == [16, 0, 16, 0]


def test_laid_out_neox_rotation_is_cohere_interleaved_rotation() -> None:
    """Our neox rotation (the torch path, the CPU kernel and the fused CUDA kernels all turn (i, i + head_dim / 2))
    of the laid-out dims equals transformers' Cohere rotation of the checkpoint's dims."""
    from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb

    from radixserve.layers.rotary_embedding import RotaryEmbedding
    from radixserve.models.glm4 import rotary_order

    head, pos = 16, torch.arange(7)
    inv = 1.0 / (10000.0 ** (torch.arange(0, head, 2).float() / head))
    emb = torch.repeat_interleave(pos[:, None] * inv, 2, dim=-1)  # as CohereRotaryEmbedding
    q, k = torch.randn(7, 2 * head), torch.randn(7, head)
    want_q, want_k = apply_rotary_pos_emb(q.view(1, 7, 2, head).transpose(1, 2), k.view(1, 7, 1, head).transpose(1, 2),
                                          emb.cos()[None], emb.sin()[None])
    order = rotary_order(head, head, interleaved=True)
    got_q, got_k = RotaryEmbedding(head, 64, 10000.0)(pos, q.view(7, 2, head)[..., order].reshape(7, -1).clone(),
                                                      k[..., order].clone())
    torch.testing.assert_close(got_q.view(7, 2, head), want_q.transpose(1, 2)[0][..., order])
    torch.testing.assert_close(got_k.view(7, 1, head), want_k.transpose(1, 2)[0][..., order])


def test_fused_qkv_rotation_is_off_where_it_would_skip_the_qk_layernorm(tmp_path) -> None:  # noqa: ANN001
    """LlamaAttention's one-launch q/k/v + rotation paths have no place for a LayerNorm: the q/k-normed attention
    turns them off (and its rotary gets no RMS QKNorm); the attention without q/k norms keeps them."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.cohere import CohereForCausalLM

    for case in ("cohere_qk", "cohere"):
        cohere(case, str(tmp_path / case))
        attn = CohereForCausalLM(ModelConfig(str(tmp_path / case)).hf_config).model.layers[0].self_attn
        assert attn.qk_norm == hasattr(attn, "q_norm") == (case == "cohere_qk")
        assert attn.rotary_emb.is_neox_style  # the laid-out rows make the neox kernels right
    hidden, pos = torch.zeros(1, 64), torch.zeros(1, dtype=torch.long)
    qk_attn = CohereForCausalLM(ModelConfig(str(tmp_path / "cohere_qk")).hf_config).model.layers[0].self_attn
    assert qk_attn._qkv_rope(pos, hidden, None) is None and qk_attn._rope_args(pos, hidden, None) is None


def test_layout_parallel_block_and_qk_norm_change_the_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The Command-R cases above could not pass with the rotary pairs left in neox order, with the MLP fed the
    attention's output (sequential, as Llama) instead of the same normed input, or without the q/k norms."""
    from radixserve.model_executor import cpu_direct_calls as dc
    from radixserve.models import cohere as mod

    path = str(tmp_path)
    hf = cohere("cohere_qk", path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.self_attn.q_norm.weight.fill_(1.0)
    assert StaticBatch(runner).generate(PROMPTS, 12) != want

    def sequential(self, positions, hidden, forward_batch):  # noqa: ANN001, ANN202
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), forward_batch)
        return hidden + self.mlp(self.input_layernorm(hidden))

    with monkeypatch.context() as m:  # (the CPU's direct module calls keep the forward they were made with)
        m.setattr(dc, "ENABLED", False)
        m.setattr(mod.CohereDecoderLayer, "forward", sequential)
        assert ours(path) != want
    monkeypatch.setattr(mod, "rotary_order", lambda head_dim, rotary_dim, interleaved: None)
    assert ours(path) != want


def test_nope_on_full_layers_changes_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """Cohere2 with its full-attention layers rotated too (or with the sliding ones unrotated) gives other tokens."""
    from radixserve.models.llama import model_rotary

    path = str(tmp_path)
    hf = cohere("cohere2", path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = make_runner(path)
    rotary = model_rotary(runner.model.config)
    for layer in runner.model.model.layers:
        layer.self_attn.rotary_emb = rotary
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    runner = make_runner(path)
    nope = runner.model.model.layers[1].self_attn.rotary_emb
    for layer in runner.model.model.layers:
        layer.self_attn.rotary_emb = nope
    assert StaticBatch(runner).generate(PROMPTS, 12) != want


@pytest.mark.parametrize("case", ["cohere", "cohere2"])
def test_prompt_logprobs_come_from_scaled_logits(case: str, tmp_path) -> None:  # noqa: ANN001
    """logit_scale leaves the argmax alone (a positive factor) but not the distribution: prompt logprobs equal
    transformers' log-softmax of its scaled logits, which differ from the unscaled ones."""
    path = str(tmp_path)
    hf = cohere(case, path)
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    targets = torch.tensor(ids[1:])[:, None]
    want = torch.log_softmax(logits, -1).gather(1, targets)[:, 0]
    runner = make_runner(path)
    torch.testing.assert_close(StaticBatch(runner).prompt_logprobs(ids), want, atol=1e-4, rtol=1e-4)
    unscaled = torch.log_softmax(logits / hf.config.logit_scale, -1).gather(1, targets)[:, 0]
    assert not torch.allclose(unscaled, want, atol=1e-2)
    runner.model.logits_processor.scale = 1.0
    torch.testing.assert_close(StaticBatch(runner).prompt_logprobs(ids), unscaled, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["cohere_qk", "cohere2"])
def test_scheduler_chunked_prefill_and_prefix_cache(case: str, tmp_path) -> None:  # noqa: ANN001
    hf = cohere(case, str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_lora_b_and_head_norms_are_laid_out_per_head(tmp_path) -> None:  # noqa: ANN001
    """q/k LoRA B rows move as their base rows; the q/k norms' [heads, head_dim] weights by the same dim order;
    a norm weight of another shape is refused."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.cohere import CohereForCausalLM
    from radixserve.models.glm4 import rotary_order

    cohere("cohere_qk", str(tmp_path))
    model = CohereForCausalLM(ModelConfig(str(tmp_path)).hf_config)
    order = rotary_order(16, 16, interleaved=True)
    b = torch.arange(32, dtype=torch.float32)[:, None].expand(32, 3)
    got = model.lora_b_layout("k_proj", b)
    assert got[:16, 0].tolist() == order.tolist() and got[16:, 0].tolist() == (order + 16).tolist()
    assert torch.equal(model.lora_b_layout("v_proj", b), b)
    params = dict(model.named_parameters())
    norm = torch.arange(32, dtype=torch.float32).view(2, 16)
    model.load_weight(params, "model.layers.0.self_attn.k_norm.weight", norm)
    assert torch.equal(params["model.layers.0.self_attn.k_norm.weight"], norm[:, order])
    with pytest.raises(ValueError, match="expected \\[heads, 16\\]"):
        model.load_weight(params, "model.layers.0.self_attn.k_norm.weight", torch.ones(16))


def test_unsupported_configs_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001

    from radixserve.configs.model_config import ModelConfig

    path = str(tmp_path / "m")
    cohere("cohere", path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "hidden_act": "gelu"}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        make_runner(path)
    json.dump({**cfg, "logit_scale": 0.0}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="logit_scale must be a positive number"):
        make_runner(path)
    for arch in ("command-r", "cohere2"):
        file = stub_gguf(str(tmp_path / f"{arch}.gguf"), arch)
        with pytest.raises(ValueError, match="GGUF files of Cohere Command-R.* not supported"):
            ModelConfig(file)


def test_dummy_weights_do_not_depend_on_the_tp_split() -> None:
    """--load-format dummy generates each per-head q/k norm weight whole ([heads, head_dim]) and gives each rank
    its heads' rows (not a draw of its own at its own shape); the loader takes the whole weight only."""
    from radixserve.model_loader.dummy import initialize_dummy_weights
    from radixserve.models.cohere import HeadNorm

    whole = torch.nn.ModuleDict({"q_norm": HeadNorm(4, 16, 1e-5, 0, 4)})
    rank1 = torch.nn.ModuleDict({"q_norm": HeadNorm(2, 16, 1e-5, 2, 4)})
    initialize_dummy_weights(whole)
    initialize_dummy_weights(rank1)
    assert torch.equal(rank1.q_norm.weight, whole.q_norm.weight[2:])
    assert not torch.equal(whole.q_norm.weight[:2], whole.q_norm.weight[2:])
    with pytest.raises(ValueError, match="expected \\[heads, 16\\] with 4 heads"):
        rank1.q_norm.weight.weight_loader(rank1.q_norm.weight, torch.ones(3, 16))


@pytest.mark.integration
@pytest.mark.parametrize("case", ["cohere_qk", "cohere2"])
def test_tp2_matches_tp1(case: str, tmp_path) -> None:  # noqa: ANN001
    """Heads split over the ranks keep their layout and their q/k norm rows; one all-reduce a layer."""
    path = str(tmp_path)
    kind = "cohere2" if case == "cohere2" else "cohere"
    make_tiny_model(kind, path, seed=4, initializer_range=INIT_RANGE, **CASES[case])
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
