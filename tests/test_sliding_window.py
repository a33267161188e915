"""Sliding-window attention (Mistral's `sliding_window`, Qwen2's `use_sliding_window` per layer): the torch_native
and Triton backends against a plain reference on the kernels' edge cases, and greedy outputs token-identical to
transformers on tiny models whose window is shorter than the prompts, through batching, decode, chunked prefill and
the prefix cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves

from radixserve.bench_one_batch import StaticBatch
from radixserve.configs.model_config import ModelConfig, sliding_window_size
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode

LAYER = 0


def _triton_ok() -> bool:
    try:
        from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted
    except ImportError:
        return False
    return torch.cuda.is_available() or is_interpreted()


needs_triton = pytest.mark.skipif(not _triton_ok(), reason="needs CUDA or triton under TRITON_INTERPRET=1")
BACKENDS = ["torch_native", "cpu", pytest.param("triton", marks=needs_triton)]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], positions: list[list[int]],
              window: int, scale: float, group: int) -> torch.Tensor:
    """Each query row r (absolute position p) over keys[b][:p + 1][-window:], one at a time, in float64."""
    out = []
    row = 0
    for k, v, pos in zip(keys, values, positions, strict=True):
        for p in pos:
            lo = max(0, p - window + 1) if window > 0 else 0
            kk = k[lo:p + 1].double().repeat_interleave(group, dim=1)  # [n, H, D]
            vv = v[lo:p + 1].double().repeat_interleave(group, dim=1)
            s = torch.einsum("hd,nhd->hn", q[row].double(), kk) * scale
            out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vv))
            row += 1
    return torch.stack(out).float()


def run_backend(name: str, prefix_lens: list[int], extend_lens: list[int], window: int, decode: bool,
                min_split_len: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    heads, kv_heads, dim = 4, 2, 16
    g = torch.Generator().manual_seed(sum(prefix_lens) + 7 * window)
    totals = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    r2t = ReqToTokenPool(8, 512, DEVICE)
    pool = TokenToKVPool(2048, torch.float32, kv_heads, dim, num_layers=1, device=DEVICE)
    k_buf, v_buf = pool.get_kv_buffer(LAYER)
    k_buf.fill_(float("nan"))  # a read of a slot outside every window would poison the output
    v_buf.fill_(float("nan"))
    rows = r2t.alloc(len(totals))
    slots = pool.alloc(sum(totals))
    slots = slots[torch.randperm(len(slots), generator=g)]
    keys, values, positions, out_locs, start = [], [], [], [], 0
    for row, pre, total in zip(rows, prefix_lens, totals, strict=True):
        mine = slots[start:start + total]
        start += total
        r2t.write(row, 0, mine)
        k = torch.randn(total, kv_heads, dim, generator=g)
        v = torch.randn(total, kv_heads, dim, generator=g)
        k_buf[mine[:pre].to(DEVICE)] = k[:pre].to(DEVICE)
        v_buf[mine[:pre].to(DEVICE)] = v[:pre].to(DEVICE)
        keys.append(k)
        values.append(v)
        positions.append(list(range(pre, total)))
        out_locs.append(mine[pre:])
    r2t.apply_writes(r2t.take_pending_writes())
    new_k = torch.cat([k[p:] for k, p in zip(keys, prefix_lens, strict=True)])
    new_v = torch.cat([v[p:] for v, p in zip(values, prefix_lens, strict=True)])
    q = torch.randn(len(new_k), heads, dim, generator=g)
    runner = SimpleNamespace(device=DEVICE, model_config=SimpleNamespace(num_attention_heads=heads,
                             num_key_value_heads=kv_heads, head_dim=dim), tp_size=1, dtype=torch.float32,
                             req_to_token_pool=r2t, token_to_kv_pool=pool)
    if name == "triton":
        from radixserve.layers.attention.triton_backend import TritonAttnBackend

        backend = TritonAttnBackend(runner)
        backend.min_split_len = min_split_len
    elif name == "cpu":
        from radixserve.layers.attention.cpu_backend import CpuAttnBackend

        backend = CpuAttnBackend(runner)
    else:
        backend = TorchNativeAttnBackend(runner)

    def dev(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=DEVICE)

    fb = ForwardBatch(forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, batch_size=len(totals),
                      input_ids=torch.zeros(len(q), dtype=torch.int64, device=DEVICE), req_pool_indices=dev(rows),
                      seq_lens=dev(totals), out_cache_loc=torch.cat(out_locs).to(DEVICE), seq_lens_sum=sum(totals),
                      positions=None, req_to_token_pool=r2t, token_to_kv_pool=pool, attn_backend=backend,
                      seq_lens_cpu=list(totals))  # type: ignore[arg-type]
    if not decode:
        fb.extend_seq_lens, fb.extend_prefix_lens = dev(extend_lens), dev(prefix_lens)
        fb.extend_start_loc = dev([sum(extend_lens[:i]) for i in range(len(extend_lens))])
        fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(extend_lens), list(prefix_lens)
    layer = SimpleNamespace(tp_q_head_num=heads, tp_k_head_num=kv_heads, tp_v_head_num=kv_heads, head_dim=dim,
                            scaling=dim ** -0.5, layer_id=LAYER, sliding_window_size=window)
    backend.init_forward_metadata(fb)
    out = backend.forward(q.reshape(len(q), -1).to(DEVICE), new_k.reshape(len(q), -1).to(DEVICE),
                          new_v.reshape(len(q), -1).to(DEVICE), layer, fb)
    ref = reference(q, keys, values, positions, window, dim ** -0.5, heads // kv_heads)
    return out.view(-1, heads, dim).float().cpu(), ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [-1, 1, 5, 24, 40])
def test_extend_with_window(backend: str, window: int) -> None:
    # a request with no prefix and a long extend, one whose prefix is longer than the window, a one-token extend
    out, ref = run_backend(backend, [0, 70, 33, 3], [75, 9, 1, 30], window, decode=False)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [-1, 1, 7, 24, 200])
def test_decode_with_window(backend: str, window: int) -> None:
    # min_split_len 8: the window's KV is cut into several splits (and the full sequence into more)
    out, ref = run_backend(backend, [0, 4, 39, 130], [1, 1, 1, 1], window, decode=True, min_split_len=8)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_window_read_from_configs() -> None:
    mistral = SimpleNamespace(sliding_window=4096)
    assert [sliding_window_size(mistral, i) for i in range(2)] == [4096, 4096]
    assert sliding_window_size(SimpleNamespace(sliding_window=None), 0) == -1
    assert sliding_window_size(SimpleNamespace(), 0) == -1
    qwen_off = SimpleNamespace(sliding_window=4096, use_sliding_window=False, max_window_layers=0)
    assert sliding_window_size(qwen_off, 1) == -1
    qwen_on = SimpleNamespace(sliding_window=64, use_sliding_window=True, max_window_layers=2)
    assert [sliding_window_size(qwen_on, i) for i in range(4)] == [-1, -1, 64, 64]
    typed = SimpleNamespace(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    assert [sliding_window_size(typed, i) for i in range(2)] == [16, -1]
    with pytest.raises(ValueError, match="sliding_window"):
        sliding_window_size(SimpleNamespace(sliding_window=-3), 0)


# ------------------------------------------------------------------------------------------- whole models
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3],
           [200, 100, 50, 25, 12, 6, 3, 1, 9, 10, 11, 12, 13, 30, 31, 32, 33, 34, 35, 36, 37]]


def tiny_windowed(kind: str, path: str, window: int = 6) -> object:
    import transformers as tf

    torch.manual_seed(3)
    if kind == "mistral":
        cfg = tf.MistralConfig(**TINY, sliding_window=window, tie_word_embeddings=False)
    else:  # qwen2: layer 0 full, layer 1 sliding
        cfg = tf.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=window, max_window_layers=1,
                             tie_word_embeddings=False)
    model = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # sharper attention and non-trivial norms, so that which keys are seen shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(4.0)
    model.save_pretrained(path)
    return model


# the Triton kernels run under the CPU interpreter here (slow): one model, fewer tokens; the kernel tests above
# cover their window cases
@pytest.mark.parametrize("kind,backend,steps", [("mistral", "torch_native", 20), ("qwen2", "cpu", 20),
                                                pytest.param("mistral", "triton", 8, marks=needs_triton)])
def test_greedy_matches_transformers_with_a_short_window(kind: str, backend: str, steps: int, tmp_path) -> None:
    hf = tiny_windowed(kind, str(tmp_path))
    windows = ModelConfig(str(tmp_path)).sliding_windows
    assert windows == ([6, 6] if kind == "mistral" else [-1, 6])
    runner = make_runner(str(tmp_path), attention_backend=backend)
    ours = StaticBatch(runner).generate(PROMPTS, steps)
    want = [hf_greedy(hf, p, steps) for p in PROMPTS]
    assert ours == want
    # the window matters for these prompts: full attention gives other tokens
    hf.config.sliding_window = 10**6
    assert [hf_greedy(hf, p, steps) for p in PROMPTS] != want


def test_scheduler_chunked_prefill_and_prefix_cache_keep_the_window(tmp_path) -> None:
    """Chunks of 5 tokens, prompts sharing cached prefixes longer than the window, mixed batches."""
    hf = tiny_windowed("mistral", str(tmp_path), window=4)
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]
