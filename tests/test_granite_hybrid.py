"""IBM Granite 4.0's hybrid models (`GraniteMoeHybridForCausalLM`) against transformers in float32 on tiny random
models: Mamba2 layers (two groups of heads) beside an attention layer, MoE and dense, with and without RoPE. Greedy
tokens on the CPU backends (a prompt longer than the scan's chunk); through the scheduler with 5-token chunks, with
and without the prefix cache; prefix-cache hits request by request. Also the chunked scan against its recurrent
step, the extend's state checkpoint, the padding row of decode, the layer kinds read from either config key, and
what the model refuses."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves
from parallel_utils import tp2_and_tp1_outputs
from test_hybrid_prefix_cache import check_hits

from radixserve.bench_one_batch import StaticBatch
from radixserve.layers import linear_attention
from radixserve.layers.mamba2 import Mamba2Mixer, ssd_chunked, ssd_step

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [2, 3, 4], list(range(30, 110))]  # 80 > CHUNK
LAYERS = ["mamba", "attention", "mamba", "mamba"]
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, layer_types=LAYERS,
              mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=16, shared_intermediate_size=48, num_experts_per_tok=2, embedding_multiplier=6.0,
              attention_multiplier=0.05, residual_multiplier=0.4, logits_scaling=4.0, tie_word_embeddings=False,
              pad_token_id=0, initializer_range=0.1)


def _config(moe: bool = True, rope: bool = False, **kw: Any) -> Any:
    import transformers as tf

    return tf.GraniteMoeHybridConfig(**{**COMMON, "num_local_experts": 8 if moe else 0,
                                        "position_embedding_type": "rope" if rope else None, **kw})


def granite_hybrid(path: str, moe: bool = True, rope: bool = False, seed: int = 0) -> torch.nn.Module:
    """A tiny Granite 4.0 hybrid saved at `path`; norms, D and the routers away from their initial values, the
Mamba2 decays slow so that the state carries far."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = _config(moe, rope)
    cfg._attn_implementation = "eager"
    hf = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".D"):
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("A_log"):  # slow decays (A near -0.15, dt near 0.5): a long memory in the state
                p.copy_(torch.randn_like(p) * 0.5 - 2.0)
            if name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.3 - 0.5)
            if name.endswith("mamba.out_proj.weight"):
                p.mul_(4.0)  # the Mamba2 layers' share of the residual stream well above the attention's
            if name.endswith("router.weight"):
                p.mul_(40.0)  # routers with clear winners
    hf.save_pretrained(path)
    return hf


def random_mixer(slots: int = 4) -> Mamba2Mixer:
    """A float32 Mamba2 layer of the tiny config (seed 0) with random weights and state rows for `slots` requests."""
    torch.manual_seed(0)
    mixer = Mamba2Mixer(_config()).float()
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0.0, 0.3)
    mixer.allocate_states(slots, torch.float32, "cpu")
    return mixer


def _extend_batch(lens: list[int], prefixes: list[int], rows: list[int], cuts: Any = None) -> Any:
    return SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: False), extend_seq_lens_cpu=lens,
                           extend_prefix_lens_cpu=prefixes, state_checkpoints=cuts,
                           req_pool_indices=torch.tensor(rows))


@pytest.mark.parametrize("moe,rope", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_greedy_matches_transformers(moe: bool, rope: bool, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = granite_hybrid(str(tmp_path), moe, rope)
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert runner.model_config.linear_attention_layers == [0, 2, 3] and runner.model_config.kv_layer_count == 1
    assert len(runner.token_to_kv_pool.k_buffer) == 1
    assert StaticBatch(runner).generate(PROMPTS, 10) == [hf_greedy(hf, p, 10) for p in PROMPTS]


def check_logits(hf: torch.nn.Module, path: str, prompt: list[int]) -> None:
    """The prefill's last logits equal transformers' (float32)."""
    sb = StaticBatch(make_runner(path))
    batch, _ = sb.prefill([prompt])
    got = sb.last_logits.next_token_logits[0].float()
    sb.release(batch)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def check_state_matters(hf: torch.nn.Module, path: str, prompts: list[list[int]], mixers: int) -> None:
    """The greedy test could not pass with the Mamba2 state dropped between decode steps."""
    want = [hf_greedy(hf, p, 10) for p in prompts]
    runner = make_runner(path)
    layers = runner.model.model.mixers()
    assert len(layers) == mixers
    original = Mamba2Mixer._decode

    def forgetful(self, xbc, dt, forward_batch):  # noqa: ANN001, ANN202
        self.states.ssm.zero_()
        return original(self, xbc, dt, forward_batch)

    for m in layers:
        m._decode = forgetful.__get__(m)
    assert StaticBatch(runner).generate(prompts, 10) != want


def check_scheduler_waves(hf: torch.nn.Module, path: str, cache: bool) -> None:
    """5-token chunks (each starting from the state the one before left), decodes in mixed steps; with the prefix
    cache the second wave starts from the first's state snapshots."""
    assert scheduler_waves(path, expect_hits=cache, disable_radix_cache=not cache) == \
        [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_prefill_logits_match_transformers(tmp_path) -> None:  # noqa: ANN001
    check_logits(granite_hybrid(str(tmp_path)), str(tmp_path), PROMPTS[2])


def test_the_mamba_state_matters(tmp_path) -> None:  # noqa: ANN001
    check_state_matters(granite_hybrid(str(tmp_path)), str(tmp_path), PROMPTS, 3)


@pytest.mark.parametrize("cache", [True, False])
def test_scheduler_chunks_carry_the_state(cache: bool, tmp_path) -> None:  # noqa: ANN001
    check_scheduler_waves(granite_hybrid(str(tmp_path)), str(tmp_path), cache)


def test_prefix_cache_hits_request_by_request(tmp_path) -> None:  # noqa: ANN001
    """The hits the Qwen hybrids' test expects (a shared head from its third request, a next turn, a repeated
    prompt, n > 1's shared prefill), with Granite's Mamba2 states in the snapshots."""
    check_hits(str(tmp_path), "granite", build=lambda path: granite_hybrid(path, moe=False))


def test_chunked_scan_equals_the_recurrence() -> None:
    torch.manual_seed(0)
    seqs, length, heads, groups, p, n = 2, 150, 6, 3, 8, 5  # two full chunks and a partial one
    x, b, c = torch.randn(seqs, length, heads, p), torch.randn(seqs, length, groups, n), \
        torch.randn(seqs, length, groups, n)
    dt, a = torch.rand(seqs, length, heads) * 0.5, -torch.rand(heads) * 2
    s0 = torch.randn(seqs, heads, p, n)
    out, final = ssd_chunked(s0.clone(), x, dt, a, b, c)
    state, want = s0, []
    for t in range(length):  # the recurrence written out, head by head of its group
        bt = b[:, t].repeat_interleave(heads // groups, dim=1)  # [S, H, N]
        ct = c[:, t].repeat_interleave(heads // groups, dim=1)
        decay, u = (dt[:, t] * a).exp()[..., None, None], dt[:, t, :, None] * x[:, t]
        state = state * decay + u[..., None] * bt[:, :, None]
        want.append((state * ct[:, :, None]).sum(-1))
        y, _ = ssd_step(state, x[:, t], torch.zeros_like(dt[:, t]), a, b[:, t], c[:, t])  # the step's readout
        torch.testing.assert_close(y, want[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, torch.stack(want, dim=1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, state, atol=1e-4, rtol=1e-4)
    stepped, st = [], s0
    for t in range(length):
        y, st = ssd_step(st, x[:, t], dt[:, t], a, b[:, t], c[:, t])
        stepped.append(y)
    torch.testing.assert_close(out, torch.stack(stepped, dim=1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ssd_chunked(s0, x, dt, a, b, c, chunk=7)[0], out, atol=1e-4, rtol=1e-4)


def test_extend_equals_decode_steps() -> None:
    """An extend of a fresh request and a continuing one (padded together) equals feeding their tokens one decode
    step at a time: outputs, conv windows and states."""
    mixer = random_mixer()
    lens, prefixes, rows = [9, 70], [0, 3], [1, 2]
    mixer.states.ssm.normal_()
    mixer.states.conv.normal_()
    before = mixer.states.ssm.clone(), mixer.states.conv.clone()
    hidden = torch.randn(sum(lens), 64)
    extended = mixer(hidden, _extend_batch(lens, prefixes, rows))
    after = mixer.states.ssm.clone(), mixer.states.conv.clone()
    mixer.states.ssm.copy_(before[0])
    mixer.states.conv.copy_(before[1])
    mixer.states.ssm[1].zero_()
    mixer.states.conv[1].zero_()
    outs, start = [], 0
    for row, n in zip(rows, lens, strict=True):
        for t in range(start, start + n):
            batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True),
                                    req_pool_indices=torch.tensor([row]), out_cache_loc=torch.tensor([5]))
            outs.append(mixer(hidden[t:t + 1], batch))
        start += n
    torch.testing.assert_close(extended, torch.cat(outs), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixer.states.ssm, after[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixer.states.conv, after[1])


def test_checkpoint_copies_the_state_after_its_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint 25 tokens into request 0's extend: the snapshot row holds the state of those 25 tokens run
    alone, and the outputs and final states are the whole extend's (also with requests cut into pieces)."""
    mixer = random_mixer()
    lens = [40, 30]
    hidden = torch.randn(sum(lens), 64)
    whole = mixer(hidden, _extend_batch(lens, [0, 0], [0, 1]))
    final = mixer.states.ssm[:2].clone(), mixer.states.conv[:2].clone()
    mixer(hidden[:25], _extend_batch([25], [0], [2]))  # request 0's first 25 tokens alone, into row 2
    want = mixer.states.ssm[2].clone(), mixer.states.conv[2].clone()
    for pad_tokens in (4096, 16):
        monkeypatch.setattr(linear_attention, "PAD_TOKENS", pad_tokens)
        mixer.states.ssm.zero_()
        mixer.states.conv.zero_()
        torch.testing.assert_close(mixer(hidden, _extend_batch(lens, [0, 0], [0, 1], [(0, 25, 3)])), whole,
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mixer.states.ssm[:2], final[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mixer.states.conv[:2], final[1])
        torch.testing.assert_close(mixer.states.ssm[3], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mixer.states.conv[3], want[1])
        assert mixer.states.ssm[3].abs().sum() > 0


def test_padding_rows_write_the_padding_row() -> None:
    """CUDA-graph padding (request slot 0, KV slot 0) writes the extra row; a real request in slot 0 keeps its own."""
    mixer = random_mixer()
    mixer.states.ssm.normal_()
    mixer.states.conv.normal_()
    x = torch.randn(3, 64)
    decode = SimpleNamespace(is_decode=lambda: True)
    batch = SimpleNamespace(forward_mode=decode, req_pool_indices=torch.tensor([0, 2, 0]),
                            out_cache_loc=torch.tensor([7, 9, 0]))
    ssm0, conv0 = mixer.states.ssm.clone(), mixer.states.conv.clone()
    out = mixer(x, batch)
    ssm1 = mixer.states.ssm.clone()
    mixer.states.ssm.copy_(ssm0)
    mixer.states.conv.copy_(conv0)
    alone = SimpleNamespace(forward_mode=decode, req_pool_indices=torch.tensor([0, 2]),
                            out_cache_loc=torch.tensor([7, 9]))
    torch.testing.assert_close(mixer(x[:2], alone), out[:2])
    torch.testing.assert_close(mixer.states.ssm[:4], ssm1[:4])
    assert mixer.states.padding_row == 4 and not torch.equal(ssm1[4], ssm0[4]) and torch.equal(ssm1[1], ssm0[1])


def test_fused_decode_step_equals_the_torch_step() -> None:
    """The Triton scan step (interpreted here) against the torch step: outputs with the D skip and the rows it
    updates in place, with 2 groups of heads, a head width that is not a power of two (masked rows) and the padding
    row in the batch twice; then the layer's whole decode with the kernel on and off."""
    from radixserve.layers.triton_ops import set_fused_kernels
    from radixserve.layers.triton_ops.ssd_decode import ssd_decode

    torch.manual_seed(0)
    heads, p, n, groups, bs = 4, 24, 16, 2, 5
    state = torch.randn(7, heads, p, n)
    rows = torch.tensor([3, 0, 6, 5, 6])  # 6: the padding row, twice
    xbc = torch.randn(bs, heads * p + 2 * groups * n)
    dt, a, d = torch.rand(bs, heads), -torch.rand(heads), torch.randn(heads)
    x, b, c = xbc.split([heads * p, groups * n, groups * n], dim=-1)
    want, new = ssd_step(state[rows], x.reshape(bs, heads, p), dt, a, b.reshape(bs, groups, n),
                         c.reshape(bs, groups, n))
    want = want + x.reshape(bs, heads, p) * d[:, None]
    want_state = state.clone()
    want_state[rows[:4]] = new[:4]
    got = ssd_decode(state, rows, xbc, dt, a, d, groups)
    torch.testing.assert_close(got[:4], want[:4].reshape(4, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[:6], want_state[:6], atol=1e-5, rtol=1e-5)

    mixer = random_mixer()
    mixer.states.ssm.normal_()
    mixer.states.conv.normal_()
    start = mixer.states.ssm.clone(), mixer.states.conv.clone()
    hidden = torch.randn(3, 64)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True),
                            req_pool_indices=torch.tensor([2, 0, 0]), out_cache_loc=torch.tensor([7, 9, 0]))
    plain = mixer(hidden, batch), mixer.states.ssm.clone(), mixer.states.conv.clone()
    mixer.states.ssm.copy_(start[0])
    mixer.states.conv.copy_(start[1])
    set_fused_kernels(True)
    try:
        fused = mixer(hidden, batch)
    finally:
        set_fused_kernels(None)
    torch.testing.assert_close(fused, plain[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixer.states.ssm, plain[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixer.states.conv, plain[2])
    assert not torch.equal(plain[1], start[0])


def test_states_are_sized_and_layer_kinds_read(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.hybrid import linear_attention_layers

    granite_hybrid(str(tmp_path))
    runner = make_runner(str(tmp_path), max_running_requests=6)
    mixer = runner.model.model.mixers()[0]
    channels = 128 + 2 * 2 * 16  # x, then B and C of two groups
    assert mixer.states.ssm.shape == (7 + 6 + 1, 8, 16, 16) and mixer.states.conv.shape == (14, channels, 3)
    assert runner.state_bytes == 3 * (channels * 3 * 4 + 8 * 16 * 16 * 4)
    assert len(runner.model.state_buffers()) == 3 and runner.state_pool is not None
    # the released configs' key and names, transformers 5's, and Qwen3.5's
    assert linear_attention_layers(SimpleNamespace(layers_block_type=LAYERS)) == [0, 2, 3]
    assert linear_attention_layers(SimpleNamespace(layer_types=["linear_attention", "full_attention"])) == [0]
    assert linear_attention_layers(SimpleNamespace(layer_types=["sliding_attention", "full_attention"])) == []


def test_refusals(tmp_path) -> None:  # noqa: ANN001
    from radixserve.models.granitemoehybrid import GraniteMoeHybridForCausalLM

    with pytest.raises(ValueError, match="mamba_n_heads 8 and mamba_n_groups 2 must be divisible by the tensor "
                                         "parallel size 4"):
        GraniteMoeHybridForCausalLM(_config(), tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="mamba_n_groups 3 must divide"):
        Mamba2Mixer(_config(mamba_n_groups=3))
    with pytest.raises(ValueError, match="position_embedding_type 'alibi'"):
        GraniteMoeHybridForCausalLM(_config(position_embedding_type="alibi"))


def test_tp_shards_match_the_whole_layer() -> None:
    """Two TP=2 ranks loaded from the whole layer's tensors (the checkpoint's names and shapes): each holds its
    heads, groups and channels, half the state, and gives its half of the gated-norm output (what out_proj's
    all-reduce sums) of a fresh extend and the decode step after it."""
    from radixserve.models.llama import load_plain

    whole = random_mixer()
    full = {name: p.detach().clone() for name, p in whole.named_parameters()}
    hidden = torch.randn(9, 64)

    def run(mixer: Mamba2Mixer) -> tuple[torch.Tensor, torch.Tensor]:
        outs = []
        for step, batch in enumerate([_extend_batch([6, 3], [0, 0], [1, 2]),
                                      SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True),
                                                      req_pool_indices=torch.tensor([1, 2]),
                                                      out_cache_loc=torch.tensor([5, 6]))]):
            x = hidden[:9] if step == 0 else hidden[:2]
            z, xbc, dt = mixer.in_proj(x).split([mixer.inner, mixer.channels, mixer.heads], dim=-1)
            dt = torch.nn.functional.softplus(dt.float() + mixer.dt_bias.float())
            y = mixer._extend(xbc, dt, batch) if step == 0 else mixer._decode(xbc, dt, batch)
            outs.append(mixer._gated_norm(y, z))
        return outs[0], outs[1]

    want = run(whole)
    for rank in range(2):
        part = Mamba2Mixer(_config(), tp_rank=rank, tp_size=2).float()
        assert (part.heads, part.groups, part.inner, part.channels) == (4, 1, 64, 64 + 2 * 16)
        with torch.no_grad():
            for name, p in part.named_parameters():
                load_plain(p, name, full[name])
        part.allocate_states(4, torch.float32, "cpu")
        assert part.state_bytes(torch.float32) * 2 == whole.state_bytes(torch.float32)
        assert part.out_proj.weight.shape == (64, 64)
        torch.testing.assert_close(part.out_proj.weight, whole.out_proj.weight[:, rank * 64:(rank + 1) * 64])
        for got, ref in zip(run(part), want, strict=True):
            torch.testing.assert_close(got, ref[:, rank * 64:(rank + 1) * 64], atol=1e-5, rtol=1e-5)


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path)
    granite_hybrid(path, seed=3)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want


def test_tp_dummy_weights_are_the_whole_layers_shards() -> None:
    """The dummy loader fills each TP rank's Mamba2 parameters with its shard of the TP=1 layer's."""
    from radixserve.model_loader.dummy import initialize_dummy_weights

    whole = Mamba2Mixer(_config()).float()
    initialize_dummy_weights(whole)
    full = dict(whole.named_parameters())
    channels = [slice(0, 128), slice(128, 160), slice(160, 192)]  # x, B, C of the whole layer
    for rank in range(2):
        part = Mamba2Mixer(_config(), tp_rank=rank, tp_size=2).float()
        initialize_dummy_weights(part)
        got = dict(part.named_parameters())
        conv = torch.cat([full["conv_weight"][s][rank * (s.stop - s.start) // 2:(rank + 1) * (s.stop - s.start) // 2]
                          for s in channels])
        torch.testing.assert_close(got["conv_weight"], conv)
        for name in ("dt_bias", "A_log", "D", "norm_weight"):
            n = got[name].shape[0]
            torch.testing.assert_close(got[name], full[name][rank * n:(rank + 1) * n])
        torch.testing.assert_close(got["out_proj.weight"], full["out_proj.weight"][:, rank * 64:(rank + 1) * 64])
        rows = [(0, 128), (128, 128), (256, 32), (288, 32), (320, 8)]  # z, x, B, C, dt
        want = torch.cat([full["in_proj.weight"][s + rank * n // 2:s + (rank + 1) * n // 2] for s, n in rows])
        torch.testing.assert_close(got["in_proj.weight"], want)
