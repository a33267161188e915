"""Double-sparsity attention: its Triton kernels against torch references (the CPU runs them under
TRITON_INTERPRET=1), the backend against dense attention when its top-k keeps every token, the label cache, the
channel file, the calibrate command and the server flags."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from test_triton_attention import DEVICE, LAYER_ID, make_batch, make_layer, make_runner  # noqa: E402

from radixserve.layers.attention.double_sparsity_backend import (  # noqa: E402
    CHANNEL_FILE_FORMAT,
    DoubleSparseAttnBackend,
    load_channel_file,
    select_heavy_tokens,
    sparse_attention_ref,
)
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from radixserve.layers.attention.triton_ops.double_sparsity import (  # noqa: E402
    ds_score_fwd,
    ds_sparse_decode_fwd,
    topk_positions,
)
from radixserve.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402


def write_channel_file(path: str, num_layers: int, num_kv_heads: int, head_dim: int, seed: int = 0) -> str:
    gen = torch.Generator().manual_seed(seed)
    channels = [[torch.randperm(head_dim, generator=gen).tolist() for _ in range(num_kv_heads)]
                for _ in range(num_layers)]
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"format": CHANNEL_FILE_FORMAT, "num_layers": num_layers, "num_kv_heads": num_kv_heads,
                   "head_dim": head_dim, "channels": channels}, f)
    return path


def scattered_requests(lens: list[int], num_kv_heads: int, channels: int, gen: torch.Generator,
                       pool_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A label buffer and a request table whose requests' tokens sit at random slots."""
    labels = torch.randn(pool_size + 1, num_kv_heads, channels, generator=gen)
    r2t = torch.zeros(len(lens) + 2, max(lens) + 8, dtype=torch.int32)
    slots = torch.randperm(pool_size, generator=gen)[:sum(lens)] + 1
    rows = torch.arange(len(lens)) + 1  # row 0 unused: a wrong row shows
    start = 0
    for row, n in zip(rows.tolist(), lens, strict=True):
        r2t[row, :n] = slots[start:start + n].to(torch.int32)
        start += n
    return labels, r2t, rows, torch.tensor(lens)


# ---------------------------------------------------------------- kernels against torch
@pytest.mark.parametrize("num_heads,num_kv_heads,channels", [(4, 2, 8), (3, 3, 5), (8, 1, 16)])
def test_score_kernel_matches_torch(num_heads: int, num_kv_heads: int, channels: int) -> None:
    gen = torch.Generator().manual_seed(1)
    lens = [37, 1, 80]
    labels, r2t, rows, seq_lens = scattered_requests(lens, num_kv_heads, channels, gen)
    q_label = torch.randn(len(lens), num_heads, channels, generator=gen)
    n_cols = max(lens) + 5  # columns past every length must come out -inf
    scores = torch.full((len(lens), num_kv_heads, n_cols), 7.0)
    dev = torch.device(DEVICE)
    out = scores.to(dev)
    ds_score_fwd(q_label.to(dev), labels.to(dev), r2t.to(dev), rows.to(dev), seq_lens.to(dev), out, 2, 3)
    out = out.cpu()
    group = num_heads // num_kv_heads
    for b, n in enumerate(lens):
        kl = labels[r2t[rows[b], :n].long()]  # [n, Hkv, C]
        ref = torch.einsum("kgc,lkc->kgl", q_label[b].view(num_kv_heads, group, channels), kl).amax(dim=1)
        ref[:, :2] = ref[:, n - 3:] = float("inf")  # the first 2 and last 3 positions: always kept
        torch.testing.assert_close(out[b, :, :n], ref, rtol=1e-5, atol=1e-5)
        assert torch.isneginf(out[b, :, n:]).all()


def test_score_kernel_gathers_q_channels() -> None:
    """The backend's form: q [bs, H, D] with each head's heavy channels gathered in the kernel."""
    gen = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads, head_dim, channels = 6, 2, 16, 4
    lens = [300, 77]
    labels, r2t, rows, seq_lens = scattered_requests(lens, num_kv_heads, channels, gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    q_ch = torch.stack([torch.randperm(head_dim, generator=gen)[:channels] for _ in range(num_heads)])
    dev = torch.device(DEVICE)
    want = torch.empty(len(lens), num_kv_heads, max(lens), device=dev)
    ds_score_fwd(q.gather(2, q_ch.unsqueeze(0).expand(len(lens), -1, -1)).to(dev), labels.to(dev), r2t.to(dev),
                 rows.to(dev), seq_lens.to(dev), want, 2, 3)
    got = torch.empty_like(want)
    ds_score_fwd(q.to(dev), labels.to(dev), r2t.to(dev), rows.to(dev), seq_lens.to(dev), got, 2, 3,
                 q_channels=q_ch.to(dev))
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="q_channels"):
        ds_score_fwd(q.to(dev), labels.to(dev), r2t.to(dev), rows.to(dev), seq_lens.to(dev), got,
                     q_channels=q_ch[:, :2].to(dev))


@pytest.mark.parametrize("chunks", [1, 3, 4, 50])
def test_chunked_topk_keeps_the_same_positions(chunks: int) -> None:
    gen = torch.Generator().manual_seed(chunks)
    scores = torch.randn(2, 3, 1003, generator=gen)
    scores[1, :, 700:] = float("-inf")  # a shorter request's padding
    got = topk_positions(scores, 40, chunks)
    want = scores.topk(40, dim=-1).indices
    assert got.shape == want.shape
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)


def _sparse_case(lens: list[int], dense_len: int, top_k: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool = 1024
    _, r2t, rows, seq_lens = scattered_requests(lens, num_kv_heads, 1, gen, pool)
    k_buf = torch.randn(pool + 1, num_kv_heads, head_dim, generator=gen)
    v_buf = torch.randn(pool + 1, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    # per request and KV head: top_k distinct positions (padding picks past seq_len where seq_len < top_k)
    top = torch.stack([torch.stack([torch.randperm(max(n, top_k), generator=gen)[:top_k]
                                    for _ in range(num_kv_heads)]) for n in lens])
    dev = torch.device(DEVICE)
    splits = 4
    o = torch.empty_like(q).to(dev)
    mid_o = torch.empty(len(lens), num_heads, 16, head_dim, device=dev)
    mid_lse = torch.empty(len(lens), num_heads, 16, device=dev)
    ds_sparse_decode_fwd(q.to(dev), k_buf.to(dev), v_buf.to(dev), o, r2t.to(dev), rows.to(dev), seq_lens.to(dev),
                         top.to(dev), dense_len, mid_o, mid_lse, head_dim ** -0.5, splits, min_split_len=8)
    o = o.cpu()
    for b, n in enumerate(lens):
        slots = r2t[rows[b], :n].long()
        sel = None
        if n > dense_len:
            sel = torch.stack([t[t < n] for t in top[b]]) if n < top_k else top[b]
        ref = sparse_attention_ref(q[b], k_buf[slots], v_buf[slots], sel, head_dim ** -0.5)
        torch.testing.assert_close(o[b], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 32), (2, 2, 16), (6, 2, 24)])
def test_sparse_decode_kernel_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    # a dense request (at the threshold), sparse ones, one with more splits than its picks fill
    _sparse_case([40, 41, 150, 97], dense_len=40, top_k=24, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim)


def test_sparse_decode_kernel_skips_padding_picks() -> None:
    # threshold below top_k: a request shorter than top_k gets picks past its end (top-k of a padded row)
    _sparse_case([9, 30, 3], dense_len=2, top_k=40, num_heads=4, num_kv_heads=2, head_dim=16, seed=3)


def test_select_heavy_tokens_keeps_the_best_by_group_max() -> None:
    q_label = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # two query heads of one KV head
    k_labels = torch.tensor([[[0.1, 0.1]], [[5.0, -9.0]], [[-9.0, 4.0]], [[1.0, 1.0]]])
    # group max: 0.1, 5.0, 4.0, 1.0 -> positions 1 and 2 (each liked by one head only; a sum would drop 1 and 2)
    assert sorted(select_heavy_tokens(q_label, k_labels, 2)[0].tolist()) == [1, 2]
    assert sorted(select_heavy_tokens(q_label, k_labels, 2, keep_last=1)[0].tolist()) == [1, 3]  # 3: the newest


# ---------------------------------------------------------------- the backend
def _ds_backend(runner, tmp_path, kernels: str, **kw) -> DoubleSparseAttnBackend:  # noqa: ANN001
    cfg = runner.model_config
    cfg.num_hidden_layers = 2
    path = write_channel_file(str(tmp_path / "ch.json"), 2, cfg.num_key_value_heads, cfg.head_dim)
    return DoubleSparseAttnBackend(runner, channel_config_path=path, kernels=kernels, **kw)


def _decode_through(backend, runner, prefix_lens: list[int], seed: int = 0):  # noqa: ANN001, ANN202
    """Decode one token per request over prefixes whose labels the backend wrote (an extend first)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = runner.model_config
    layer = make_layer(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    fb, q, k, v = make_batch(runner, backend, [0] * len(prefix_lens), prefix_lens, ForwardMode.EXTEND, gen)
    backend.init_forward_metadata(fb)
    backend.forward(q, k, v, layer, fb)
    rows = fb.req_pool_indices
    slots = runner.token_to_kv_pool.alloc(len(prefix_lens))
    for row, n, s in zip(rows.tolist(), prefix_lens, slots.tolist(), strict=True):
        runner.req_to_token_pool.write(row, n, torch.tensor([s]))
    runner.req_to_token_pool.apply_writes(runner.req_to_token_pool.take_pending_writes())
    lens = [n + 1 for n in prefix_lens]
    fb.forward_mode, fb.seq_lens, fb.seq_lens_cpu = ForwardMode.DECODE, torch.tensor(lens, device=DEVICE), lens
    fb.out_cache_loc = slots.to(DEVICE)
    fb.extend_seq_lens = fb.extend_prefix_lens = fb.extend_start_loc = None
    fb.extend_seq_lens_cpu = fb.extend_prefix_lens_cpu = None
    shape = (len(lens), -1)
    q = torch.randn(len(lens), cfg.num_attention_heads * cfg.head_dim, generator=gen).to(DEVICE).view(shape)
    k = torch.randn(len(lens), cfg.num_key_value_heads * cfg.head_dim, generator=gen).to(DEVICE).view(shape)
    v = torch.randn(len(lens), cfg.num_key_value_heads * cfg.head_dim, generator=gen).to(DEVICE).view(shape)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)
    ref = TorchNativeAttnBackend(runner)
    ref.init_forward_metadata(fb)
    return out, ref.forward(q, k, v, layer, fb, save_kv_cache=False), layer, fb, k


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_topk_covering_every_token_equals_dense(kernels: str, tmp_path) -> None:  # noqa: ANN001
    runner = make_runner(4, 2, 32, torch.float32)
    # threshold 0: every request takes the sparse path; top-k 64 >= every length keeps every token
    backend = _ds_backend(runner, tmp_path, kernels, heavy_channel_num=4, heavy_token_num=64,
                          sparse_decode_threshold=0)
    out, ref, *_ = _decode_through(backend, runner, [5, 63, 30])
    assert backend.forward_metadata.sparse
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_triton_and_torch_paths_pick_the_same_tokens(tmp_path) -> None:  # noqa: ANN001
    outs = []
    for kernels in ("triton", "torch"):
        runner = make_runner(4, 2, 32, torch.float32)
        backend = _ds_backend(runner, tmp_path, kernels, heavy_channel_num=8, heavy_token_num=16,
                              sparse_decode_threshold=20)
        out, ref, *_ = _decode_through(backend, runner, [12, 70, 45], seed=5)
        outs.append(out)
        assert (out[0] - ref[0]).abs().max() < 1e-4  # 13 tokens <= threshold: dense
        assert (out[1] - ref[1]).abs().max() > 1e-3  # 71 tokens, 16 kept: not dense
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_labels_hold_the_heavy_channels_of_stored_keys(tmp_path) -> None:  # noqa: ANN001
    runner = make_runner(4, 2, 32, torch.float32)
    backend = _ds_backend(runner, tmp_path, "torch", heavy_channel_num=6)
    _, _, layer, fb, k = _decode_through(backend, runner, [9, 4])
    ch = backend.k_channels[layer.layer_id]
    want = k.view(-1, 2, 32).gather(2, ch.unsqueeze(0).expand(k.shape[0], -1, -1))
    assert torch.equal(backend.labels[LAYER_ID][fb.out_cache_loc], want)
    assert backend.labels[LAYER_ID].shape == (runner.token_to_kv_pool.get_kv_buffer(0)[0].shape[0], 2, 6)


def test_channel_file_is_checked(tmp_path) -> None:  # noqa: ANN001
    path = write_channel_file(str(tmp_path / "c.json"), 2, 2, 8)
    assert len(load_channel_file(path, 2, 2, 8)[1][0]) == 8
    with pytest.raises(ValueError, match="calibrated for"):
        load_channel_file(path, 3, 2, 8)
    data = json.load(open(path))
    data["channels"][0][1] = [0] * 8
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="permutation"):
        load_channel_file(str(bad), 2, 2, 8)
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        load_channel_file(str(tmp_path / "x.json"), 2, 2, 8)
    with pytest.raises(ValueError, match="does not exist"):
        load_channel_file(str(tmp_path / "missing.json"), 2, 2, 8)


def test_backend_rejects_bad_settings(tmp_path) -> None:  # noqa: ANN001
    runner = make_runner(4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="heavy-channel-num"):
        _ds_backend(runner, tmp_path, "torch", heavy_channel_num=33)
    with pytest.raises(ValueError, match="ds-channel-config-path"):
        DoubleSparseAttnBackend(runner)


def test_server_flags_need_the_backend_and_a_channel_file(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="need --attention-backend double_sparsity"):
        ServerArgs(ds_heavy_token_num=64).validate()
    with pytest.raises(ValueError, match="needs --ds-channel-config-path"):
        ServerArgs(attention_backend="double_sparsity").validate()
    with pytest.raises(ValueError, match="is not a file"):
        ServerArgs(attention_backend="double_sparsity", ds_channel_config_path=str(tmp_path / "no.json")).validate()
    path = write_channel_file(str(tmp_path / "c.json"), 1, 1, 8)
    with pytest.raises(ValueError, match="ds-heavy-token-num"):
        ServerArgs(attention_backend="double_sparsity", ds_channel_config_path=path, ds_heavy_token_num=0).validate()
    ServerArgs(attention_backend="double_sparsity", ds_channel_config_path=path, ds_heavy_token_num=8).validate()


# ---------------------------------------------------------------- calibrate + the model path
def test_calibrated_model_decodes_like_dense_when_every_token_is_kept(tmp_path) -> None:  # noqa: ANN001
    from model_utils import make_runner as make_model_runner
    from model_utils import make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.calibrate_double_sparsity import main as calibrate

    path, ch = str(tmp_path / "m"), str(tmp_path / "ch.json")
    make_tiny_model("llama", path)
    data = calibrate(["--model-path", path, "--out", ch, "--device", "cpu", "--dtype", "float32", "--num-tokens",
                      "96", "--seq-len", "48"])
    assert (data["num_layers"], data["num_kv_heads"], data["head_dim"]) == (2, 2, 16)
    assert data["tokens"] == 96 and load_channel_file(ch, 2, 2, 16)
    prompts = [[5, 9, 17, 3, 3, 80, 41], [7] * 20]
    dense = StaticBatch(make_model_runner(path)).generate(prompts, 12)
    # with pages of 16 tokens: the labels follow the KV slots, wherever the page table puts them
    runner = make_model_runner(path, attention_backend="double_sparsity", ds_channel_config_path=ch,
                               ds_heavy_channel_num=4, ds_heavy_token_num=64, ds_sparse_decode_threshold=0,
                               page_size=16)
    assert isinstance(runner.attn_backend, DoubleSparseAttnBackend)
    assert StaticBatch(runner).generate(prompts, 12) == dense
    # one label row per row of the K buffer: 2 KV heads x 4 channels
    assert runner.attn_backend.labels[0].shape == (runner.token_to_kv_pool.get_kv_buffer(0)[0].shape[0], 2, 4)


def test_calibration_text_is_encoded_without_the_context_length_warning(embedded_model_path: str,
                                                                       capfd) -> None:  # noqa: ANN001
    """The command encodes more text than the model's context (it cuts the ids into --seq-len sequences after):
    the tokenizer's "... will result in indexing errors" warning must not reach the user."""
    from radixserve.calibrate_double_sparsity import sample_ids
    from radixserve.managers.tokenizer_utils import get_tokenizer

    tok = get_tokenizer(embedded_model_path, False)
    ids = sample_ids(tok, "hello world, " * 3000, 9000)  # SmolLM2's context: 8,192 tokens
    assert len(ids) == 9000
    assert "indexing errors" not in capfd.readouterr().err


def test_calibrate_help_shows_its_defaults(capsys) -> None:  # noqa: ANN001
    from radixserve.calibrate_double_sparsity import main as calibrate

    with pytest.raises(SystemExit):
        calibrate(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 8192)", "(default: 1024)", "(default: qk)"):
        assert default in text


def test_embedded_model_agrees_with_dense_at_2k_context(embedded_model_path: str, tmp_path) -> None:  # noqa: ANN001
    """SmolLM2-135M, 2,048 tokens of text, 128 decode steps teacher-forced on the dense greedy output: keeping 512
    tokens per KV head (a quarter) on 16 of 64 channels agrees with dense on >= 95% of the steps. The text is the
    Python reference's topics (`pydoc_data`, fixed for a Python version) for the calibration (8,192 tokens, the
    command's default) and the decode, not the bench's default of this package's sources, which every edit to the
    package changes (on 2026-12-01 they moved this figure from above 95% to 92.9%)."""
    import pydoc_data.topics

    from model_utils import load_benchmark

    text_file = tmp_path / "topics.txt"
    text_file.write_text("\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)),
                         encoding="utf-8")

    bench = load_benchmark("bench_double_sparsity")
    args = bench.build_parser().parse_args(
        ["accuracy", "--model-path", embedded_model_path, "--context", "2048", "--heavy-token-num", "512",
         "--steps", "128", "--calib-tokens", "8192", "--no-free-running", "--channel-file-out",
         str(tmp_path / "ch.json"), "--text-file", str(text_file)])
    (row,) = bench.bench_accuracy(args)
    assert row["teacher_forced_agreement"] >= 0.95, row
    assert row["kl_dense_to_ds"] < 0.05, row


def decodes_beside_a_chunk(tmp_path, runs: list[dict]) -> list[dict[str, list[int]]]:  # noqa: ANN001
    """Greedy tokens of a request past the sparse threshold (`a`) while another prompt (`b`) prefills in chunks of
    16, once per entry of `runs` (extra server args); also the GPU test's."""
    from model_utils import make_tiny_model
    from test_scheduler import drain, make_scheduler, submit

    path = str(tmp_path / "m")
    make_tiny_model("llama", path, seed=1, vocab_size=512)
    ch = write_channel_file(str(tmp_path / "ch.json"), 2, 2, 16)
    kw = dict(attention_backend="double_sparsity", ds_channel_config_path=ch, ds_heavy_channel_num=4,
              ds_heavy_token_num=4, ds_sparse_decode_threshold=8, chunked_prefill_size=16)
    a, b = [11, 22, 33, 44, 55, 66], [(7 * i) % 400 + 20 for i in range(60)]

    def run(extra: dict) -> dict[str, list[int]]:
        s = make_scheduler(path, **{**kw, **extra})
        submit(s, "a", a, 16)
        for _ in range(5):
            s.step()
        submit(s, "b", b, 4)  # its four chunks run with a's decodes riding along (mixed chunks, a step budget)
        return {rid: r["ids"] for rid, r in drain(s).items()}

    return [run(extra) for extra in runs]


def test_decodes_riding_with_a_prefill_chunk_decode_sparsely(tmp_path) -> None:  # noqa: ANN001
    """A request past the threshold decodes over its heavy tokens also in the steps where it rides along with
    another prompt's chunk (MIXED): it was attended densely there, so its tokens depended on what else arrived."""
    plain, *others = decodes_beside_a_chunk(tmp_path, [{}, {"enable_mixed_chunk": True}, {"step_token_budget": 8},
                                                       {"enable_mixed_chunk": True, "enable_overlap_schedule": True,
                                                        "page_size": 4}])
    assert all(o == plain for o in others)
