"""Hunyuan dense and MoE against transformers in float32 on tiny random models: q/k RMS-normed per head after the
rotation, NTK-alpha rotary ("dynamic" with alpha: a fixed stretched base), tied embeddings, MoE layers with a
float32 softmax router (top-k per layer, renormalised) and an unweighted shared MLP; the cpu and torch_native
backends, the scheduler with chunked prefill and the prefix cache, TP=2 over gloo, dummy weights and refusals."""

from __future__ import annotations

import json

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, initializer_range=0.1,  # varied tokens
            # the releases' NTK-alpha scaling (Hunyuan-7B: alpha 50; A13B: 1000)
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0, "factor": 1.0})


def hunyuan(path: str, moe: bool = True, seed: int = 0, **over: object) -> torch.nn.Module:
    """A tiny Hunyuan (MoE: 4 experts, top-2 in layer 0 and top-1 in layer 1) with q/k norm weights far from 1 (their
    place against the rotation shows) and routers whose second choice still weighs."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, **over}
    cfg = tf.HunYuanMoEV1Config(**{"num_experts": 4, "moe_topk": [2, 1], **kw}) if moe else \
        tf.HunYuanDenseV1Config(**kw)
    hf = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.5)
            if name.endswith(("query_layernorm.weight", "key_layernorm.weight")):
                p.mul_(3.0)
            if name.endswith("gate.wg.weight"):
                p.mul_(4.0)
    hf.save_pretrained(path)
    return hf


def greedy(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


def _edit_config(path: str, **changes: object) -> None:
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("moe,backend", [(False, "cpu"), (True, "cpu"), (False, "torch_native"),
                                         (True, "torch_native")])
def test_greedy_matches_transformers(moe: bool, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = hunyuan(str(tmp_path), moe)
    assert greedy(str(tmp_path), attention_backend=backend) == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_qk_norm_after_rotation_and_ntk_alpha_change_the_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The cases above could not pass with the q/k norms applied before the rotation (Qwen3's order), or with the
    alpha left out of the rotary base."""
    from radixserve.models.hunyuan import HunyuanAttention

    def norm_then_rotate(self: HunyuanAttention, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape[0], -1)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape[0], -1)
        return self.rotary_emb(positions, q, k)

    path = str(tmp_path)
    hf = hunyuan(path, moe=False)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert greedy(path) == want
    with monkeypatch.context() as m:
        m.setattr(HunyuanAttention, "rotate_then_norm", norm_then_rotate)
        assert greedy(path) != want
    _edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert greedy(path) != want


def test_shared_mlp_and_per_layer_top_k_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The MoE cases above could not pass without the shared MLP, or with one top-k for every layer."""
    path = str(tmp_path)
    hf = hunyuan(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.mlp.shared_expert = None
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    _edit_config(path, moe_topk=[2, 2])
    assert greedy(path) != want


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = hunyuan(str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_dummy_weights(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path)
    hunyuan(path)
    out = StaticBatch(make_runner(path, load_format="dummy")).generate(PROMPTS, 4)
    assert [len(o) for o in out] == [4, 4, 4]


def test_unsupported_configs_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.hunyuan import HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM

    path = str(tmp_path)
    hunyuan(path)
    for change, match in (({"use_cla": True}, "use_cla"), ({"use_qk_norm": False}, "use_qk_norm"),
                          ({"num_experts": [4, 4]}, "num_experts"),
                          ({"moe_intermediate_size": [64, 32]}, "moe_intermediate_size"),
                          ({"num_shared_expert": [1, 2]}, "num_shared_expert"),
                          ({"use_mixed_mlp_moe": False}, "use_mixed_mlp_moe"),
                          ({"moe_topk": [2]}, "moe_topk")):
        cfg = ModelConfig(path).hf_config
        cfg.__dict__.update(change)  # (past the config's own type checks, as a remote-code config would be)
        with pytest.raises(ValueError, match=match):
            HunYuanMoEV1ForCausalLM(cfg)
    cfg = ModelConfig(path).hf_config
    cfg.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    cfg.rope_scaling = cfg.rope_parameters
    with pytest.raises(ValueError, match="without alpha"):
        HunYuanDenseV1ForCausalLM(cfg)
    for arch in ("hunyuan-moe", "hunyuan-dense"):
        with pytest.raises(ValueError, match="GGUF files of Hunyuan"):
            ModelConfig(stub_gguf(str(tmp_path / f"{arch}.gguf"), arch))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """Heads split (per-head q/k norms), experts' and the shared MLP's intermediate slices, the tied head split."""
    path = str(tmp_path)
    hunyuan(path, seed=3, initializer_range=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
