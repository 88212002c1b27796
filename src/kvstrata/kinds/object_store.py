"""An S3-compatible object store shared by workers (G4)."""

from __future__ import annotations

from ..placement.costs import CostPrior
from ..tiers import TierKind
from .base import Kind


class ObjectStoreKind(Kind):
    kind = TierKind.OBJECT
    cost_prior = CostPrior(bandwidth=100e6, overhead=20e-3)


KIND = ObjectStoreKind()
