"""The scheduler's side of LoRA adapters: which adapter a request may use, loading at run time, and unloading once
no request uses the adapter any more. A mixin of Scheduler."""

from __future__ import annotations

import logging

from radixserve.managers import io_struct as io

logger = logging.getLogger(__name__)


class SchedulerLoRAMixin:
    def check_lora_id(self, lora_id: str | None) -> str | None:
        """Why a request cannot use adapter `lora_id` (None: it can)."""
        if lora_id is None:
            return None
        if self.lora_manager is None:
            return f"LoRA adapter {lora_id!r} requested, but this server serves no adapters (--lora-paths / " \
                   "--enable-lora)"
        if lora_id not in self.lora_manager.adapters:
            return f"LoRA adapter {lora_id!r} is not loaded"
        if lora_id in self.lora_unloads:
            return f"LoRA adapter {lora_id!r} is being unloaded"
        return None

    def load_lora_adapter(self, req: io.LoadLoRAAdapterReq) -> None:
        if self.lora_manager is None:
            ok, msg = False, "this server serves no LoRA adapters (start it with --enable-lora or --lora-paths)"
        elif req.name in self.lora_unloads:
            ok, msg = False, f"LoRA adapter {req.name!r} is being unloaded; retry"
        else:
            try:
                host = self.lora_manager.load_adapter(req.name, req.path)
                ok, msg = True, f"loaded LoRA adapter {req.name!r} (rank {host.rank})"
            except (ValueError, OSError) as e:
                ok, msg = False, str(e)
        self.send_out(io.LoadLoRAAdapterReqOutput(ok, msg, seq=req.seq, name=req.name))

    def finish_lora_unloads(self) -> None:
        """Unload the adapters asked for that no request uses any more (new requests for them already fail)."""
        in_use = {r.lora_id for r in self._live_reqs() if not r.finished()}
        for name in [n for n in self.lora_unloads if n not in in_use]:
            seq = self.lora_unloads.pop(name)
            if self.lora_manager is None or name not in self.lora_manager.adapters:
                self.send_out(io.UnloadLoRAAdapterReqOutput(False, f"LoRA adapter {name!r} is not loaded", seq, name))
                continue
            try:
                self.flush_results()  # a batch in flight may still hold its last requests' cache locks
                self.tree_cache.drop_namespace(name)
                self.lora_table.forget(name)
                self.lora_manager.unload_adapter(name)
            except Exception as e:  # reported to the caller; the scheduler goes on
                logger.exception("unloading LoRA adapter %r failed", name)
                self.send_out(io.UnloadLoRAAdapterReqOutput(False, f"unloading LoRA adapter {name!r} failed: {e}",
                                                            seq, name))
                continue
            self.send_out(io.UnloadLoRAAdapterReqOutput(True, f"unloaded LoRA adapter {name!r}", seq, name))
