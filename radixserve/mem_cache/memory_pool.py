"""The two memory pools.

ReqToTokenPool: a [max_requests, max_context_len] int32 table on the device; row = request slot, entries = the
KV slot of each of that request's tokens. Free rows are a Python list.

TokenToKVPool: per-layer K and V buffers [size + page_size (rounded up to 128), num_kv_heads, head_dim]; slot 0 is
padding (writes of padded tokens land there). With --page-size P > 1 the allocator hands out whole pages: page p
holds slots p*P .. p*P + P-1, page 0 (which holds the padding slot) is never handed out, and the free list holds page
ids. A request's slots stay token-level in the request table (backends that read through it are unchanged); a
request's last page is filled slot by slot (`alloc_extend` continues it from the request's last slot, `alloc_decode`
takes the next slot of the last page or a new page), and `free` frees every page that one of the given slots lies in,
so whoever owns a page frees it whole. With an fp8 dtype (float8_e4m3fn / float8_e5m2) a slot holds k / k_scale (v /
v_scale), saturated to the format's range; readers multiply by the layer's scale (`store_kv_values` /
`load_kv_values`).
The free slots (pages) are an int64 tensor on the CPU: alloc is a slice, free a concatenation, so the scheduler never
waits for the device.
"""

from __future__ import annotations

import numpy as np
import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
BUFFER_ROW_ALIGN = 128


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES


def store_kv_values(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What a pool of `dtype` stores for the values x: x itself cast, or for fp8 x / scale saturated and cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def load_kv_values(stored: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """The values a pool slot holds, in `dtype` (fp8 slots times their scale)."""
    if not is_fp8(stored.dtype):
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype) if scale != 1.0 else stored.to(dtype)


def gather_kv(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf[slots], also for fp8 buffers (gathered as bytes)."""
    if is_fp8(buf.dtype):
        return buf.view(torch.uint8)[slots].view(buf.dtype)
    return buf[slots]


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str) -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"ReqToTokenPool needs positive sizes; got size={size}, context={max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        # A CPU mirror: the scheduler and the radix cache read KV slots from it without touching the device.
        self.req_to_token_cpu = torch.zeros((size, max_context_len), dtype=torch.int32) if device != "cpu" \
            else self.req_to_token
        self.free_slots: list[int] = list(range(size))
        self._is_free = [True] * size
        # Device writes are queued and applied by whoever runs the next forward (the worker thread under overlap
        # scheduling), so the scheduler thread never touches the device. The CPU mirror is updated at once.
        self.pending_writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need: int = 1) -> list[int] | None:
        if need > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:need], self.free_slots[need:]
        for i in out:
            self._is_free[i] = False
        return out

    def free(self, idx: int | list[int]) -> None:
        for i in [idx] if isinstance(idx, int) else idx:
            if not 0 <= i < self.size:
                raise ValueError(f"request slot {i} is out of range 0..{self.size - 1}")
            if self._is_free[i]:
                raise ValueError(f"request slot {i} is freed twice")
            self._is_free[i] = True
            self.free_slots.append(i)

    def write(self, row: int, start: int, values: torch.Tensor) -> None:
        """Record KV slots (a CPU tensor) for tokens start.. of request slot `row`, on the device and the mirror."""
        end = start + len(values)
        if end > self.max_context_len:
            raise ValueError(f"request needs {end} tokens, more than the context length {self.max_context_len}")
        self.write_batch(torch.full((end - start,), row, dtype=torch.int64), torch.arange(start, end),
                         values.to(torch.int32))

    def write_batch(self, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor,
                    host: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        """req_to_token[rows[i], cols[i]] = values[i] (CPU tensors): the mirror now, the device at the next forward.
        `host`: the same three as numpy arrays, where the caller has them."""
        # through numpy: a few microseconds, against ~10-15 for the same indexed store as a torch op (every step)
        r, c, v = host if host is not None else (rows.numpy(), cols.numpy(), values.numpy())
        self.req_to_token_cpu.numpy()[r, c] = v
        if self.req_to_token_cpu is not self.req_to_token:
            self.pending_writes.append((rows, cols, values))  # values of any int dtype: the device store casts

    def take_pending_writes(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        writes, self.pending_writes = self.pending_writes, []
        return writes

    def apply_writes(self, writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Apply queued writes to the device table, in the order they were made (a later write to a cell wins).

        No write holds the same cell twice (each covers distinct (row, col) pairs), so one indexed store per write,
        issued in order on the stream, is exact. On CUDA all of them travel in one pinned buffer and one copy."""
        if not writes:
            return
        dev = self.req_to_token.device
        if dev.type != "cuda":
            for rows, cols, vals in writes:
                self.req_to_token[rows.to(dev), cols.to(dev)] = vals.to(dev, torch.int32)
            return
        host = self.flatten_writes(writes)
        self.apply_device_writes(writes, host.pin_memory().to(dev, non_blocking=True))

    @staticmethod
    def flatten_writes(writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The writes as one int64 host tensor (rows, cols, values of each write in turn), for one copy."""
        return torch.cat([t.to(torch.int64) for w in writes for t in w])

    def apply_device_writes(self, writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                            d: torch.Tensor) -> None:
        """Apply `writes` from `d`, their flatten_writes already on the device (the writes give the lengths)."""
        off = 0
        for rows, _, _ in writes:
            n = len(rows)
            self.req_to_token[d[off:off + n], d[off + n:off + 2 * n]] = d[off + 2 * n:off + 3 * n].to(torch.int32)
            off += 3 * n

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """KV slots of tokens start..end-1 of request slot `row`, as a CPU int64 tensor (no device sync)."""
        return self.req_to_token_cpu[row, start:end].to(torch.int64)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))
        self._is_free = [True] * self.size
        self.pending_writes = []


class TokenToKVPool:
    def __init__(self, size: int, dtype: torch.dtype, num_kv_heads: int, head_dim: int, num_layers: int,
                 device: str, debug_checks: bool = True, page_size: int = 1) -> None:
        self._init_pages(size, page_size)
        self.dtype = dtype
        self.device = device
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_layers = num_layers
        self.k_buffer = [torch.zeros((self.buffer_rows, num_kv_heads, head_dim), dtype=dtype, device=device)
                         for _ in range(num_layers)]
        self.v_buffer = [torch.zeros((self.buffer_rows, num_kv_heads, head_dim), dtype=dtype, device=device)
                         for _ in range(num_layers)]
        # Double-free / range checks keep a CPU bitmap; it costs O(n) CPU work per call, never a device sync.
        self.debug_checks = debug_checks
        self.clear()

    def _init_pages(self, size: int, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"--page-size must be a positive integer; got {page_size}")
        if size < page_size:
            raise ValueError(f"the KV pool needs at least one page ({page_size} tokens); got {size} tokens")
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size  # whole pages only
        # rows of each buffer: page 0 and the pages, rounded up to 128 (never handed out): the same shape at every
        # page size, and whole blocks for kernels that read the pool in blocks (flex)
        self.buffer_rows = -(-(self.size + page_size) // BUFFER_ROW_ALIGN) * BUFFER_ROW_ALIGN

    # ---------------------------------------------------------------- allocator (CPU only)
    def clear(self) -> None:
        # numpy arrays: the allocator runs before every step, and numpy's slices and indexed stores on a few
        # elements cost a fraction of torch's
        self.free_slots = np.arange(1, self.num_pages + 1, dtype=np.int64)  # page ids when page_size > 1
        self._is_free = np.ones(self.num_pages + 1, dtype=np.bool_)
        self._is_free[0] = False

    def available_size(self) -> int:
        """Free tokens (free pages times the page size)."""
        return len(self.free_slots) * self.page_size

    def take_pages_np(self, n: int) -> np.ndarray | None:
        """`n` free pages (slots when page_size is 1) as an int64 numpy array, or None if there are not enough.
        The array is a slice of the free list that no later free writes (frees build new arrays)."""
        free = self.free_slots
        if n > len(free):
            return None
        out, self.free_slots = free[:n], free[n:]
        if self.debug_checks:
            self._is_free[out] = False
        return out

    def _take_pages(self, n: int) -> torch.Tensor | None:
        out = self.take_pages_np(n)
        return None if out is None else torch.from_numpy(out)

    def alloc(self, need: int) -> torch.Tensor | None:
        """`need` free slots as a CPU int64 tensor, or None if there are not enough. With pages: the first `need`
        slots of ceil(need / page_size) fresh pages (the caller owns those pages whole)."""
        if need < 0:
            raise ValueError(f"cannot allocate {need} slots")
        p = self.page_size
        pages = self._take_pages(-(-need // p))
        if pages is None or p == 1:
            return pages
        return (pages[:, None] * p + torch.arange(p)).flatten()[:need]

    def extend_tokens_needed(self, prefix_lens: list[int], seq_lens: list[int]) -> int:
        """Tokens (whole new pages) that `alloc_extend` will take for these requests."""
        p = self.page_size
        if p == 1:
            return sum(seq_lens) - sum(prefix_lens)
        return p * sum(-(-s // p) - -(-pre // p) for pre, s in zip(prefix_lens, seq_lens, strict=True))

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """Slots for positions prefix_len .. seq_len-1 of each request, concatenated. A request whose prefix ends
        inside a page (its own: the prefix cache only shares whole pages) continues that page after its last slot
        `last_locs[i]`; the rest comes from new pages. None if there are not enough free pages."""
        p = self.page_size
        if p == 1:
            return self.alloc(sum(seq_lens) - sum(prefix_lens))
        pages = self._take_pages(self.extend_tokens_needed(prefix_lens, seq_lens) // p)
        if pages is None:
            return None
        parts: list[torch.Tensor] = []
        used = 0
        for pre, s, last in zip(prefix_lens, seq_lens, last_locs, strict=True):
            if s <= pre:
                continue
            head = min(s, -(-pre // p) * p) - pre  # slots left in the prefix's last page
            if head > 0:
                if last < p or last % p != (pre - 1) % p:
                    raise ValueError(f"alloc_extend: slot {last} does not continue a partly filled page")
                parts.append(torch.arange(last + 1, last + 1 + head, dtype=torch.int64))
            n_new = -(-s // p) - -(-pre // p)
            if n_new:
                mine = pages[used:used + n_new]
                used += n_new
                parts.append((mine[:, None] * p + torch.arange(p)).flatten()[:s - pre - head])
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def decode_tokens_needed(self, seq_lens: torch.Tensor | np.ndarray) -> int:
        """Tokens (whole new pages) that `alloc_decode` will take: one page per request whose new token starts one."""
        if self.page_size == 1:
            return len(seq_lens)
        return int(np.count_nonzero((np.asarray(seq_lens) - 1) % self.page_size == 0)) * self.page_size

    def alloc_decode(self, seq_lens: torch.Tensor, last_locs: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for its token at position seq_len - 1: the slot after `last_locs` (the slot of
        position seq_len - 2) in the same page, or the first slot of a new page. None if no page is free."""
        out = self.alloc_decode_np(np.asarray(seq_lens), np.asarray(last_locs))
        return None if out is None else torch.from_numpy(out)

    def alloc_decode_np(self, seq_lens: np.ndarray, last_locs: np.ndarray) -> np.ndarray | None:
        """`alloc_decode` on numpy arrays (int64 slots); what a decode step runs on the host."""
        p = self.page_size
        if p == 1:
            return self.take_pages_np(len(seq_lens))
        new_page = (seq_lens - 1) % p == 0
        pages = self.take_pages_np(int(np.count_nonzero(new_page)))
        if pages is None:
            return None
        out = last_locs.astype(np.int64) + 1
        out[new_page] = pages * p
        return out

    def free(self, idx: torch.Tensor) -> None:
        """Free the given slots; with pages, every page that one of them lies in (each page once)."""
        if idx.numel() == 0:
            return
        idx = idx.to("cpu", torch.int64).flatten()
        if self.page_size > 1:
            idx = torch.unique(idx // self.page_size)
        if self.debug_checks:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 1 or hi > self.num_pages:
                what = "KV slot" if self.page_size == 1 else "KV page"
                raise ValueError(f"{what} out of range 1..{self.num_pages}: min={lo} max={hi}")
            pages = idx.numpy()
            if self._is_free[pages].any() or idx.unique().numel() != idx.numel():
                raise ValueError("KV slot freed twice")
            self._is_free[pages] = True
        self.free_slots = np.concatenate([self.free_slots, idx.numpy()])

    # ---------------------------------------------------------------- KV data (device)
    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        if is_fp8(self.dtype):  # stored as bytes: index_put of fp8 values is not on every device
            self.k_buffer[layer_id].view(torch.uint8)[loc] = store_kv_values(k, self.dtype, k_scale).view(torch.uint8)
            self.v_buffer[layer_id].view(torch.uint8)[loc] = store_kv_values(v, self.dtype, v_scale).view(torch.uint8)
            return
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        self.k_buffer[layer_id][loc] = k
        self.v_buffer[layer_id][loc] = v

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8
