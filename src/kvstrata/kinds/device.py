"""Device memory (G1): the engine's KV tensors, or a region allocated for them."""

from __future__ import annotations

from ..placement.costs import CostPrior
from ..tiers import TierKind
from .base import Kind


class DeviceKind(Kind):
    kind = TierKind.DEVICE
    cost_prior = CostPrior(bandwidth=10e9, overhead=50e-6)


KIND = DeviceKind()
