"""The hybrid Qwen models (Qwen3-Next; Qwen3.5 dense, MoE and image-text checkpoints as text) against transformers in
float32 on tiny random models: three Gated DeltaNet layers, then one gated full-attention layer with a partial
rotation. Greedy tokens on every CPU-runnable backend; through the scheduler with 5-token chunks (the recurrent state
carried from chunk to chunk, mixed steps, with and without the prefix cache); TP=2. Also the delta rule's chunked form
against its recurrent step, the state rows of CUDA-graph padding, the pool and state sizing, and what a hybrid model
refuses (its prefix cache: test_hybrid_prefix_cache.py)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves
from parallel_utils import tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch
from radixserve.layers.linear_attention import GatedDeltaNet, delta_rule_chunked, delta_rule_step, l2_normalize

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 110))]
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _text_config(kind: str, initializer_range: float) -> object:
    import transformers as tf

    kw = {**COMMON, "initializer_range": initializer_range}
    if kind == "qwen3_next":
        return tf.Qwen3NextConfig(**kw, **MOE, decoder_sparse_step=1, norm_topk_prob=False)
    if kind == "qwen3_5_moe":  # (no norm_topk_prob: Qwen3.5-MoE always renormalises the top-k weights)
        return tf.Qwen3_5MoeTextConfig(**kw, **MOE)
    return tf.Qwen3_5TextConfig(**kw)


def hybrid(path: str, kind: str = "qwen3_next", seed: int = 0, initializer_range: float = 0.2,
           router_scale: float = 40.0) -> torch.nn.Module:
    """A tiny hybrid model saved at `path` (partial rotation 0.25: 8 of 32 dims); norms, decays and routers away
    from their initial values so that each matters."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = _text_config(kind, initializer_range)
    cfg._attn_implementation = "eager"
    hf = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("mlp.gate.weight"):
                p.mul_(router_scale)  # (40: routers with clear winners)
    hf.save_pretrained(path)
    return hf


def random_delta_net(slots: int = 4) -> GatedDeltaNet:
    """A Qwen3.5-shaped Gated DeltaNet layer (float32, seed 0) with weights away from their initial values, and
    state rows for `slots` requests."""
    import transformers as tf

    torch.manual_seed(0)
    net = GatedDeltaNet(tf.Qwen3_5TextConfig(**COMMON)).float()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.3)
    net.allocate_states(slots, torch.float32, "cpu")
    return net


def as_image_text(path: str, moe: bool) -> None:
    """Rewrite a saved Qwen3.5 text model as its image-text checkpoint (config with a text_config, the language
    model's weights under model.language_model., a vision tensor beside them)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    cfg_path = os.path.join(path, "config.json")
    text = json.load(open(cfg_path))
    cls = tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config
    top = cls(text_config=text, vision_config={"depth": 1, "hidden_size": 32, "num_heads": 2,
                                               "out_hidden_size": text["hidden_size"]}).to_dict()
    top["architectures"] = ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    json.dump(top, open(cfg_path, "w"))
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    out = {(n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n): t
           for n, t in weights.items()}
    out["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    save_file(out, file)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_greedy_matches_transformers(kind: str, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = hybrid(str(tmp_path), kind)
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 10) == [hf_greedy(hf, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_moe_weights_renormalised_as_transformers(kind: str, tmp_path) -> None:  # noqa: ANN001
    """Routers without clear winners, so that the top-k weights' renormalisation shows in the logits: Qwen3-Next's
    follows norm_topk_prob (false here), Qwen3.5-MoE's always renormalises (its config has no such flag)."""
    hf = hybrid(str(tmp_path), kind, router_scale=1.0)
    sb = StaticBatch(make_runner(str(tmp_path)))
    batch, _ = sb.prefill([PROMPTS[0]])
    got = sb.last_logits.next_token_logits[0].float()
    sb.release(batch)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers_triton_interpreted(tmp_path) -> None:  # noqa: ANN001
    """The triton backend and every fused kernel as on CUDA (the DeltaNet's decode step among them), interpreted."""
    from radixserve.layers import linear_attention
    from radixserve.layers.triton_ops import set_fused_kernels

    hf = hybrid(str(tmp_path), "qwen3_5")
    runner = make_runner(str(tmp_path), attention_backend="triton")
    calls = []
    original = linear_attention.use_fused
    linear_attention.use_fused = lambda x: calls.append(1) or original(x)
    set_fused_kernels(True)
    try:
        got = StaticBatch(runner).generate(PROMPTS[:2], 5)
    finally:
        set_fused_kernels(None)
        linear_attention.use_fused = original
    assert calls and got == [hf_greedy(hf, p, 5) for p in PROMPTS[:2]]


@pytest.mark.parametrize("moe", [False, True])
def test_image_text_checkpoint_served_as_text(moe: bool, tmp_path) -> None:  # noqa: ANN001
    hf = hybrid(str(tmp_path), "qwen3_5_moe" if moe else "qwen3_5")
    as_image_text(str(tmp_path), moe)
    runner = make_runner(str(tmp_path))
    assert StaticBatch(runner).generate(PROMPTS[:2], 8) == [hf_greedy(hf, p, 8) for p in PROMPTS[:2]]


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("cache", [True, False])
def test_scheduler_chunks_carry_the_state(kind: str, cache: bool, tmp_path) -> None:  # noqa: ANN001
    """5-token chunks: each chunk starts from the state the one before left (a reset would change the tokens);
    decodes ride in mixed steps; with the prefix cache the second wave starts from the first's state snapshots."""
    hf = hybrid(str(tmp_path), kind)
    assert scheduler_waves(str(tmp_path), expect_hits=cache, disable_radix_cache=not cache) == \
        [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_the_linear_layers_and_their_state_matter(tmp_path) -> None:  # noqa: ANN001
    """The greedy test could not pass with the DeltaNet's state dropped between decode steps."""
    path = str(tmp_path)
    hf = hybrid(path, "qwen3_5")
    want = [hf_greedy(hf, p, 10) for p in PROMPTS]
    runner = make_runner(path)
    nets = runner.model.model.delta_nets()
    assert len(nets) == 3
    original = GatedDeltaNet._decode

    def forgetful(self, mixed, g, beta, forward_batch):  # noqa: ANN001, ANN202
        self.states.ssm.zero_()
        return original(self, mixed, g, beta, forward_batch)

    for net in nets:
        net._decode = forgetful.__get__(net)
    assert StaticBatch(runner).generate(PROMPTS, 10) != want


def test_chunked_delta_rule_equals_the_recurrence() -> None:
    torch.manual_seed(0)
    heads, length, dk, dv = 3, 150, 16, 8  # two full chunks and a partial one
    q = l2_normalize(torch.randn(heads, length, dk)) * dk ** -0.5
    k = l2_normalize(torch.randn(heads, length, dk))
    v, g, beta = torch.randn(heads, length, dv), -torch.rand(heads, length), torch.rand(heads, length)
    s0 = torch.randn(heads, dk, dv) * 0.1
    out, final = delta_rule_chunked(s0.clone(), q, k, v, g, beta)
    state, want = s0[None], []
    for t in range(length):
        o, state = delta_rule_step(state, q[:, t][None], k[:, t][None], v[:, t][None], g[:, t][None],
                                   beta[:, t][None])
        want.append(o[0])
    torch.testing.assert_close(out, torch.stack(want, dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, state[0], atol=1e-5, rtol=1e-5)


def test_padding_rows_write_the_padding_row() -> None:
    """A CUDA graph pads a decode batch with rows of request slot 0 and KV slot 0: their state goes to the extra
    row, so a real request in slot 0 keeps its own."""
    net = random_delta_net()
    net.states.ssm.normal_()
    net.states.conv.normal_()
    x = torch.randn(3, 64)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True),
                            req_pool_indices=torch.tensor([0, 2, 0]), out_cache_loc=torch.tensor([7, 9, 0]))
    ssm0, conv0 = net.states.ssm.clone(), net.states.conv.clone()
    out = net(x, batch)
    alone = SimpleNamespace(forward_mode=batch.forward_mode, req_pool_indices=torch.tensor([0, 2]),
                            out_cache_loc=torch.tensor([7, 9]))
    ssm1 = net.states.ssm.clone()
    net.states.ssm.copy_(ssm0)
    net.states.conv.copy_(conv0)
    torch.testing.assert_close(net(x[:2], alone), out[:2])
    torch.testing.assert_close(net.states.ssm[:4], ssm1[:4])  # slots 0 and 2 as without the padding row
    assert not torch.equal(ssm1[4], ssm0[4]) and torch.equal(ssm1[1], ssm0[1])


def test_pool_holds_the_attention_layers_and_states_are_sized(tmp_path) -> None:  # noqa: ANN001
    hybrid(str(tmp_path), "qwen3_next")
    runner = make_runner(str(tmp_path), max_running_requests=6)
    assert runner.model_config.linear_attention_layers == [0, 1, 2]
    assert runner.model_config.kv_layer_count == 1 and len(runner.token_to_kv_pool.k_buffer) == 1
    net = runner.model.model.delta_nets()[0]
    # rows: 7 request slots, 6 snapshots for the radix cache (one a running request), the padding row
    assert net.states.ssm.shape == (7 + 6 + 1, 4, 16, 16) and net.states.conv.shape == (14, 2 * 32 + 64, 3)
    assert (runner.state_pool.first_row, runner.state_pool.size, net.states.padding_row) == (7, 6, 13)
    assert make_runner(str(tmp_path), max_running_requests=6, disable_radix_cache=True).state_pool is None
    per_request = 3 * ((2 * 32 + 64) * 3 * 4 + 4 * 16 * 16 * 4)
    assert runner.state_bytes == per_request
    from radixserve.bench_one_batch import add_bandwidth

    result = {"batch_size": 2, "input_len": 8, "output_len": 4, "median_decode_s": 1e-3}
    add_bandwidth(result, runner, copy_bw=1e12)  # (an MoE model: the step's active bytes, plus the states)
    assert result["state_bytes_read"] == 2 * per_request
    assert result["step_bytes"] == result["dense_bytes"] + result["routed_bytes"] + result["kv_bytes"] + 2 * per_request


def test_hybrid_settings_and_refusals(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.hybrid import apply_hybrid_args
    from radixserve.configs.model_config import ModelConfig
    from radixserve.server_args import ServerArgs

    hybrid(str(tmp_path), "qwen3_5")
    cfg = ModelConfig(str(tmp_path))
    args = ServerArgs(model_path=str(tmp_path), device="cpu")
    apply_hybrid_args(args, cfg)
    assert not args.disable_radix_cache and args.prefill_cuda_graph_max_tokens == 0 \
        and args.piecewise_cuda_graph_max_tokens == 0
    # the radix cache's state copies travel with the batches: overlap stays beside it
    overlap = ServerArgs(model_path=str(tmp_path), device="cpu", enable_overlap_schedule=True)
    apply_hybrid_args(overlap, cfg)
    assert overlap.use_overlap and not overlap.disable_radix_cache
    no_cache = ServerArgs(model_path=str(tmp_path), device="cpu", enable_overlap_schedule=True,
                          disable_radix_cache=True)
    apply_hybrid_args(no_cache, cfg)
    assert no_cache.use_overlap
    no_snapshots = ServerArgs(model_path=str(tmp_path), device="cpu", state_snapshots=0)
    apply_hybrid_args(no_snapshots, cfg)
    assert no_snapshots.disable_radix_cache
    with pytest.raises(ValueError, match="--state-snapshots must be a non-negative integer"):
        ServerArgs(model_path=str(tmp_path), device="cpu", state_snapshots=-1)
    # an option only hybrid models read is refused for the others, not ignored
    dense = SimpleNamespace(linear_attention_layers=[], architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="--state-snapshots applies to hybrid models"):
        apply_hybrid_args(ServerArgs(model_path=str(tmp_path), device="cpu", state_snapshots=4), dense)
    apply_hybrid_args(ServerArgs(model_path=str(tmp_path), device="cpu"), dense)  # (nothing to change)
    for bad in (dict(speculative_algorithm="ngram"), dict(enable_lora=True), dict(enable_torch_compile=True)):
        with pytest.raises(ValueError, match="linear-attention layers"):
            apply_hybrid_args(ServerArgs(model_path=str(tmp_path), device="cpu", **bad), cfg)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_tp2_matches_tp1(kind: str, tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path)
    hybrid(path, kind, seed=4, initializer_range=0.1)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want


def test_fused_decode_step_equals_the_torch_step() -> None:
    """The Triton decode step (interpreted here) against the torch step: outputs and the rows it updates in place,
    with grouped value heads, an odd Dv and the padding row in the batch twice."""
    from radixserve.layers.triton_ops.delta_rule import delta_rule_decode

    torch.manual_seed(0)
    hk, hv, dk, dv, bs = 2, 4, 16, 24, 5
    state = torch.randn(7, hv, dk, dv)
    rows = torch.tensor([3, 0, 6, 5, 6])  # 6: the padding row, twice
    qkv = torch.randn(bs, 2 * hk * dk + hv * dv)
    g, beta = -torch.rand(bs, hv), torch.rand(bs, hv)
    want_state = state.clone()
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = l2_normalize(q.reshape(bs, hk, dk)).repeat_interleave(2, dim=1) * dk ** -0.5
    k = l2_normalize(k.reshape(bs, hk, dk)).repeat_interleave(2, dim=1)
    want, new = delta_rule_step(state[rows], q, k, v.reshape(bs, hv, dv), g, beta)
    want_state[rows[:4]] = new[:4]
    got = delta_rule_decode(state, rows, qkv, g, beta, hk, dk, dv)
    torch.testing.assert_close(got[:4], want[:4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[:6], want_state[:6], atol=1e-5, rtol=1e-5)


def test_padded_extend_equals_request_by_request() -> None:
    """The batched extend (each request padded to the longest) against the extend one request at a time: fresh and
    continuing requests, a one-token one; the outputs and every state row they touch."""
    net = random_delta_net()
    net.states.ssm.normal_()
    net.states.conv.normal_()
    lens, prefixes, rows = [7, 1, 70], [0, 5, 2], [1, 3, 0]
    mixed = torch.randn(sum(lens), net.channels)
    g, beta = -torch.rand(sum(lens), net.hv), torch.rand(sum(lens), net.hv)
    before = net.states.ssm.clone(), net.states.conv.clone()
    one_by_one = net._extend_each(mixed, g, beta, rows, lens, prefixes)
    after = net.states.ssm.clone(), net.states.conv.clone()
    net.states.ssm.copy_(before[0])
    net.states.conv.copy_(before[1])
    padded = net._extend_padded(mixed, g, beta, torch.tensor(rows), lens, prefixes)
    torch.testing.assert_close(padded, one_by_one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(net.states.ssm, after[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(net.states.conv, after[1])


def test_extend_memory_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked delta rule in slices of sequences (SEQ_BUDGET) equals it whole; an extend's requests go in
    consecutive groups of at most PAD_TOKENS padded tokens, a request alone where padding would double the work."""
    from radixserve.layers import linear_attention as la

    torch.manual_seed(0)
    heads, length, dk, dv = 6, 100, 16, 8
    q, k = l2_normalize(torch.randn(heads, length, dk)), l2_normalize(torch.randn(heads, length, dk))
    v, g, beta = torch.randn(heads, length, dv), -torch.rand(heads, length), torch.rand(heads, length)
    s0 = torch.randn(heads, dk, dv)
    whole = la.delta_rule_chunked(s0, q, k, v, g, beta)
    monkeypatch.setattr(la, "SEQ_BUDGET", 1)  # one sequence a slice
    sliced = la.delta_rule_chunked(s0, q, k, v, g, beta)
    torch.testing.assert_close(sliced[0], whole[0])
    torch.testing.assert_close(sliced[1], whole[1])
    assert la._pad_groups([5, 1, 7, 300, 280, 2]) == [[0, 1, 2], [3, 4, 5]]
    assert la._pad_groups([5, 1000, 7]) == [[0, 1], [2]]  # 3 x 1000 padded would be past 2 x 1012 + 3 x 64
    monkeypatch.setattr(la, "PAD_TOKENS", 500)
    assert la._pad_groups([300, 280, 250]) == [[0], [1], [2]] and la._pad_groups([200, 200]) == [[0, 1]]
    assert la._pieces([1200, 3], [0, 9]) == ([0, 0, 0, 1], [500, 500, 200, 3], [0, 500, 1000, 9], [-1] * 4)
    # a state checkpoint (request 0: after 4 tokens, into row 7) cuts a piece, whose pieces never share a group;
    # one at a request's end (request 1, row 8) cuts nothing
    cuts = la.state_cuts([(0, 4, 7), (1, 5, 8)])
    assert la._pieces([10, 5], [0, 3], cuts) == ([0, 0, 1], [4, 6, 5], [0, 4, 3], [7, -1, 8])
    assert la._pieces([10], [0], la.state_cuts([(0, 4, 7), (0, 10, 9), (0, 6, 8)])) == (
        [0, 0, 0], [4, 2, 4], [0, 4, 6], [7, 8, 9])
    assert la._pad_groups([4, 6, 5], [0, 0, 1]) == [[0], [1, 2]] and la._pad_groups([4, 6, 5]) == [[0, 1, 2]]


def test_long_extend_in_pieces_equals_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request longer than PAD_TOKENS runs in pieces that carry the state: the same outputs and state."""
    from radixserve.layers import linear_attention as la

    net = random_delta_net()
    lens, prefixes = [150, 5], [0, 0]
    mixed = torch.randn(sum(lens), net.channels)
    g, beta = -torch.rand(sum(lens), net.hv), torch.rand(sum(lens), net.hv)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: False), extend_seq_lens_cpu=lens,
                            extend_prefix_lens_cpu=prefixes, state_checkpoints=None,
                            req_pool_indices=torch.tensor([2, 1]))
    whole = net._extend(mixed, g, beta, batch)
    state = net.states.ssm.clone()
    net.states.ssm.zero_()
    net.states.conv.zero_()
    monkeypatch.setattr(la, "PAD_TOKENS", 64)
    torch.testing.assert_close(net._extend(mixed, g, beta, batch), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(net.states.ssm, state, atol=1e-5, rtol=1e-5)


def test_gguf_files_are_refused(tmp_path) -> None:  # noqa: ANN001
    from model_utils import stub_gguf

    from radixserve.configs.model_config import ModelConfig

    with pytest.raises(ValueError, match="GGUF files of Qwen3-Next are not supported"):
        ModelConfig(stub_gguf(str(tmp_path / "q.gguf"), "qwen3next"))
