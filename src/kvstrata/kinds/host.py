"""Host RAM (G2) owned by kvstrata."""

from __future__ import annotations

from ..placement.costs import CostPrior
from ..tiers import TierKind
from .base import Kind


class HostKind(Kind):
    kind = TierKind.HOST
    cost_prior = CostPrior(bandwidth=5e9, overhead=100e-6)


KIND = HostKind()
