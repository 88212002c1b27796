"""A slab file on local disk (G3)."""

from __future__ import annotations

from ..placement.costs import CostPrior
from ..tiers import TierKind
from .base import Kind


class DiskKind(Kind):
    kind = TierKind.DISK
    cost_prior = CostPrior(bandwidth=1.5e9, overhead=1e-3)


KIND = DiskKind()
