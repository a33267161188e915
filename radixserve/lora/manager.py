"""The worker side of LoRA: the adapters' host copies, the device pool of slots, the hooks in the model's linear
layers, and the per-batch row grouping (eager, and the static buffer a CUDA graph reads).

The scheduler decides which adapter sits in which slot (`slots.py`) and sends the loads with each batch; the worker
applies them in batch order on the forward stream, so a slot is overwritten only after every batch queued before
has read it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixserve.layers import cpu_ops
from radixserve.layers.triton_ops import use_fused
from radixserve.lora.adapter import LoRAWeights, read_lora_weights
from radixserve.lora.batch_info import LoRABatchInfo, layout, pack_rows
from radixserve.lora.config import TARGET_MODULES
from radixserve.lora.layers import GROUP_OF, LoRATarget, find_lora_targets
from radixserve.lora.ops import apply_lora
from radixserve.lora.pool import HostAdapter, LoRAMemoryPool

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)
DEFAULT_MAX_LORA_RANK = 64


class _LoRAHook:
    """Set as `base_layer.lora`: the base layer's output for x plus the batch's LoRA deltas."""

    def __init__(self, manager: LoRAManager, target: LoRATarget) -> None:
        key = (target.layer_id, target.group)
        self.manager, self.base, self.group, self.out_slices = manager, target.base, target.group, target.out_slices
        self.a, self.b = manager.pool.a[key], manager.pool.b[key]
        self.stacked = manager.pool.stacked.get(key)  # ([W; A] buffer, padded bias) or None
        # the one-row GEMV's tiles for the stacked buffer: the table's for the base weight (None: cuBLAS)
        self._gemv_cfg = None
        if self.stacked is not None and self.stacked[0].is_cuda:
            from radixserve.layers.triton_ops.gemv import gemv_config

            self._gemv_cfg = gemv_config(target.base.weight)

    def _stacked_row(self, x: torch.Tensor, row_slot: torch.Tensor) -> torch.Tensor:
        """One row's stacked product [W; A] x: the base output and the shrink (of the row's slot, at least)."""
        y = self._row_gemv(x, row_slot)
        return cpu_ops.linear(x, *self.stacked) if y is None else y

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a [gate; up] layer with the batch's adapters, for one row: the expand and the
        activation in one kernel after the stacked product; None where that path does not apply (the caller runs
        the layer, then SiluAndMul)."""
        m = self.manager
        info = m.info
        if self.stacked is None or x.shape[0] != 1 or not info.active or not use_fused(x) \
                or len(self.out_slices) != 2 or self.out_slices[0][1] != self.out_slices[1][1]:
            return None
        from radixserve.lora.triton_ops import lora_expand_row

        sorted_slots = info.views()[4]
        return lora_expand_row(self._stacked_row(x, sorted_slots), self.b, m.pool.scalings, self.out_slices,
                               sorted_slots, silu_mul=True)

    def _row_gemv(self, x: torch.Tensor, row_slot: torch.Tensor) -> torch.Tensor | None:
        """One row: the stacked [W; A] product through the one-row Triton GEMV with the tiles the table gives the
        base weight, as the base layer without adapters runs, reading only the A rows of the row's slot
        (`row_slot`, a device tensor: under a CUDA graph the slot changes without a capture); None where the base
        keeps cuBLAS."""
        if self._gemv_cfg is None or x.stride(-1) != 1 or x.dtype != self.stacked[0].dtype \
                or torch.compiler.is_compiling():
            return None
        from radixserve.layers.triton_ops.gemv import gemv_row
        from radixserve.lora import triton_ops

        slots = (row_slot, self.base.weight.shape[0], self.a.shape[1])
        return gemv_row(x, self.stacked[0], self.stacked[1], self._gemv_cfg, slots=slots,
                        pdl_level=triton_ops.ROW_PDL_LEVEL)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m, base = self.manager, self.base
        info = m.info
        if self.stacked is not None and info.active and use_fused(x):
            from radixserve.lora.triton_ops import lora_expand_row, lora_expand_stacked

            _, _, _, order, sorted_slots = info.views()
            if x.shape[0] == 1:
                return lora_expand_row(self._stacked_row(x, sorted_slots), self.b, m.pool.scalings, self.out_slices,
                                       sorted_slots)
            y = cpu_ops.linear(x, *self.stacked)  # the base output and every slot's shrink, one GEMM
            return lora_expand_stacked(y, self.b, m.pool.scalings, self.out_slices, order, sorted_slots,
                                       info.num_rows)
        out = base._plain_cuda(x) if base._plain and x.is_cuda else base.quant_method.apply(base, x, base.bias)
        return apply_lora(x, out, self.a, self.b, self.out_slices, info, m.pool, self.group)


class LoRAManager:
    def __init__(self, model: torch.nn.Module, num_layers: int, server_args: ServerArgs, dtype: torch.dtype,
                 device: str) -> None:
        self.num_layers = num_layers
        self.device = device
        # a model whose loader reorders some base weights' rows (Phi-3's q/k under partial rotation) lays B out too
        self.lora_b_layout: Callable[[str, torch.Tensor], torch.Tensor] | None = getattr(model, "lora_b_layout", None)
        start = [(name, self._read(path)) for name, path in server_args.lora_path_pairs()]
        self.max_rank = server_args.max_lora_rank or max((w.config.r for _, w in start),
                                                         default=DEFAULT_MAX_LORA_RANK)
        modules = server_args.lora_target_modules
        # given: the only projections an adapter may carry (the layers are patched per fused group, q/k/v and
        # gate/up, so a k_proj adapter would otherwise run where only q_proj and v_proj were asked for)
        self.allowed = set(modules) if modules else None
        for name, weights in start:
            self._check_targets(name, weights)
        if not modules:
            modules = sorted({m for _, w in start for m in w.target_modules}) or list(TARGET_MODULES)
        groups = {GROUP_OF[m] for m in modules}
        self.targets = find_lora_targets(model, groups)
        if not self.targets:
            raise ValueError(f"the model has no layers for LoRA target modules {modules}")
        self.num_slots = server_args.max_loras_per_batch
        self.pool = LoRAMemoryPool(self.targets, self.num_slots, self.max_rank, dtype, device)
        if self.pool.stacked and torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the base weights moved into the stacked buffers: free their old blocks
        self.adapters: dict[str, HostAdapter] = {}
        for name, weights in start:
            self.adapters[name] = self.pool.host_copy(name, weights)
        self.info = LoRABatchInfo(self.num_slots)
        for t in self.targets:
            t.base.lora = _LoRAHook(self, t)
        self.graph_packed: torch.Tensor | None = None
        self.is_cuda = torch.device(device).type == "cuda"
        if self.is_cuda:
            self.warmup()
        logger.info("LoRA: %d slot(s) of rank %d on %d layer(s) (%.1f MiB, %d stacked with their base weight), "
                    "adapters at start: %s", self.num_slots, self.max_rank, len(self.targets),
                    self.pool.nbytes / 2**20, len(self.pool.stacked), ", ".join(self.adapters) or "none")

    # ---------------------------------------------------------------- adapters
    def load_adapter(self, name: str, path: str) -> HostAdapter:
        """Read an adapter into host memory (it goes into a slot when a batch needs it)."""
        if not name:
            raise ValueError("a LoRA adapter needs a name")
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        weights = self._read(path)
        self._check_targets(name, weights)
        host = self.pool.host_copy(name, weights)
        self.adapters[name] = host
        return host

    def _read(self, path: str) -> LoRAWeights:
        """An adapter folder's weights, each B's rows in the model's layout of its base weight."""
        weights = read_lora_weights(path, self.num_layers)
        if self.lora_b_layout is not None:
            weights.weights = {key: (a, self.lora_b_layout(key[1], b)) for key, (a, b) in weights.weights.items()}
        return weights

    def _check_targets(self, name: str, weights: LoRAWeights) -> None:
        extra = sorted(set(weights.target_modules) - self.allowed) if self.allowed is not None else []
        if extra:
            raise ValueError(f"LoRA adapter {name!r} targets {', '.join(extra)}, which --lora-target-modules "
                             f"({', '.join(sorted(self.allowed))}) does not serve")

    def unload_adapter(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")

    def apply_loads(self, loads: list[tuple[int, str]] | None) -> None:
        """Put adapters into slots, in order, before the batch that needs them."""
        for slot, name in loads or ():
            host = self.adapters.get(name)
            if host is None:
                raise RuntimeError(f"LoRA adapter {name!r} was unloaded while a batch needed it")
            self.pool.load(slot, host)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile the LoRA kernels of every kind of layer for small and large batches now, not in the middle of
        serving (a compile takes about a second; a graph's capture covers only the decode batches it captures)."""
        if not use_fused(torch.empty(0, device=self.device)):
            return
        seen: set[tuple] = set()
        info = self.info
        for t in self.targets:
            hook: _LoRAHook = t.base.lora
            kind = (t.group, hook.stacked is not None, type(t.base.quant_method))
            if kind in seen:
                continue
            seen.add(kind)
            from radixserve.lora.triton_ops import EXPAND_WARMUP_ROWS

            for rows in EXPAND_WARMUP_ROWS:  # a batch for each block configuration of the kernels
                slots = [i % self.num_slots for i in range(rows)]
                packed, host, max_len = pack_rows(slots, None, self.num_slots)
                info.packed, info.host_groups = packed.to(self.device), host
                info.num_groups, info.max_group_len, info.capturing = len(host[1]), max_len, False
                xw = torch.zeros(rows, t.in_local, dtype=self.pool.dtype, device=self.device)
                hook(xw)
                if rows == 1:
                    hook.silu_and_mul(xw)
        info.packed, info.host_groups, info.num_groups, info.max_group_len = None, None, 0, 0
        if self.is_cuda:
            torch.cuda.synchronize()

    # ---------------------------------------------------------------- batches
    def prepare(self, forward_batch: ForwardBatch, req_slots: list[int] | None) -> None:
        """Group the batch's rows by adapter slot (one upload) for the layers' hooks."""
        info = self.info
        info.capturing = False
        forward_batch.lora_info = info
        info.req_slots = req_slots
        if req_slots is None or max(req_slots, default=-1) < 0:  # only base rows: nothing to group or upload
            info.packed, info.host_groups, info.num_groups, info.max_group_len = None, None, 0, 0
            return
        counts = forward_batch.extend_seq_lens_cpu if forward_batch.forward_mode.is_extend() else None
        packed, host, max_len = pack_rows(req_slots, counts, self.num_slots)
        if self.is_cuda:
            packed = packed.pin_memory().to(self.device, non_blocking=True)
        info.packed, info.host_groups = packed, host
        info.num_groups, info.max_group_len = len(host[1]), max_len

    def init_cuda_graph_state(self, max_bs: int) -> None:
        size = layout(self.num_slots, max_bs)[2]
        self.graph_packed = torch.zeros(size, dtype=torch.int64, device=self.device)

    def begin_capture(self, bs: int) -> None:
        """The graph reads the static buffer's first 3*slots + 2*bs values (the grouping of a batch of `bs` rows;
        all base rows while capturing). A batch of `bs` rows has at most min(slots, bs) groups, packed first: the
        grid covers those."""
        info = self.info
        info.capturing = True
        packed, _, _ = pack_rows([-1] * bs, None, self.num_slots)
        info.packed = self.graph_packed[:packed.numel()]
        info.packed.copy_(packed)
        info.num_groups, info.max_group_len, info.host_groups = min(self.num_slots, bs), bs, None

    def end_capture(self) -> None:
        self.info.capturing = False
        self.info.packed = None
        self.info.num_groups = 0

    def load_graph_inputs(self, forward_batch: ForwardBatch, bs: int) -> None:
        """Copy the batch's grouping into the graph's static buffer, for the graph's `bs` rows (the padding rows
        past the batch are base rows)."""
        info = forward_batch.lora_info
        packed = info.packed if info is not None else None
        raw = forward_batch.batch_size
        if packed is None or raw != bs:
            slots = list(info.req_slots or ()) if info is not None else []
            packed, _, _ = pack_rows(slots + [-1] * (bs - len(slots)), None, self.num_slots)
            if self.is_cuda:
                packed = packed.pin_memory()
        self.graph_packed[:packed.numel()].copy_(packed, non_blocking=True)
