"""What an expert computes between its two products, and the biases around them.

- `silu` (every family but GPT-OSS): act = SiLU(gate) * up.
- `swiglu_oai` (GPT-OSS): gate clamped from above at `limit`, up to [-limit, limit], then
  act = gate * sigmoid(alpha * gate) * (up + 1).
GPT-OSS's experts also carry biases: gate/up's added before the activation, down's before the routing weight."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "swiglu_oai")


@dataclass(frozen=True)
class ExpertActivation:
    kind: str = "silu"
    alpha: float = 1.702  # swiglu_oai only
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {', '.join(ACTIVATIONS)}; got {self.kind!r}")
        if self.kind == "swiglu_oai" and not self.limit > 0:
            raise ValueError(f"swiglu_limit must be > 0; got {self.limit}")

    @property
    def code(self) -> int:
        """The kernels' constexpr ACT: 0 silu, 1 swiglu_oai."""
        return ACTIVATIONS.index(self.kind)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


SILU = ExpertActivation()


@dataclass(frozen=True)
class ExpertBias:
    """The experts' biases in the stacked layout: w13 [E, 2I] (gate then up), w2 [E, H]; None where absent."""

    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None
