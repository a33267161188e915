"""What an expert computes between its two products, and the biases around them.

- `silu` (most families): act = SiLU(gate) * up.
- `swiglu_oai` (GPT-OSS): gate clamped from above at `limit`, up to [-limit, limit], then
  act = gate * sigmoid(alpha * gate) * (up + 1).
- `relu2` (Nemotron 3's experts): not gated, act = relu(up) ** 2; the stacked w13 holds only the up rows.
GPT-OSS's experts also carry biases: gate/up's added before the activation, down's before the routing weight."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "swiglu_oai", "relu2")


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
        """The kernels' constexpr ACT: 0 silu, 1 swiglu_oai, 2 relu2."""
        return ACTIVATIONS.index(self.kind)

    @property
    def gated(self) -> bool:
        """Whether w13 holds gate rows then up rows ([E, 2I, H]); else only up rows ([E, I, H])."""
        return self.kind != "relu2"

    def w13_rows(self, inter: int) -> int:
        """Rows of one expert's w13 for an intermediate size `inter`."""
        return 2 * inter if self.gated else inter

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """The activation of a w13 product h [..., w13_rows(I)] (gate then up, or up alone) -> [..., I]."""
        if not self.gated:
            return torch.square(F.relu(h))
        gate, up = h.chunk(2, dim=-1)
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


SILU = ExpertActivation()
RELU2 = ExpertActivation("relu2")


@dataclass(frozen=True)
class ExpertBias:
    """The experts' biases in the stacked layout: w13 [E, w13 rows] (gate then up), w2 [E, H]; None where absent."""

    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None
