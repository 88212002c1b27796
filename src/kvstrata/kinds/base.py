"""What a kind of tier provides (:class:`Kind`), and the rules its modules share."""

from __future__ import annotations

from typing import ClassVar

from ..placement.costs import CostPrior
from ..tiers import TierKind

__all__ = ["Kind"]


class Kind:
    """Everything about one kind of tier; one instance, ``KIND``, per module of
    :mod:`kvstrata.kinds`."""

    kind: ClassVar[TierKind]
    cost_prior: ClassVar[CostPrior]
    """What the cost model assumes of a copy to or from this kind before one was measured."""
