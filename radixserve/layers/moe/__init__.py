"""Mixture-of-experts layers: the router (`router.py`), the experts with their stacked weights (`layer.py`), the
expert computation behind one seam (`MoEMethod` in `methods.py`: a per-expert torch reference and the fused Triton
kernel of `fused_moe.py`).

A quantization method plugs in by subclassing `MoEMethod` (its `create_weights` decides the stacked parameters,
its `apply` the expert GEMMs) and passing it to `FusedMoE(quant_method=...)`; routing, sharding and the final
reduction stay in `FusedMoE`."""

from radixserve.layers.moe.layer import FusedMoE, load_expert_weight
from radixserve.layers.moe.router import MoEGate, RouterConfig, select_experts

__all__ = ["FusedMoE", "load_expert_weight", "MoEGate", "RouterConfig", "select_experts"]
