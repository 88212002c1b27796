"""Admission filters: whether a block offered to a tier is worth a slot there.

:data:`kvstrata.logical.filters.ADMISSION_FILTERS` names the fixed filters (these and
``predicted-reuse``, :mod:`kvstrata.logical.reuse_prediction`);
:mod:`kvstrata.logical.policy` builds them (and the ``adaptive`` one) by name.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

__all__ = ["AdmissionPolicy", "SecondOfferAdmission", "PolicyError"]


class PolicyError(ValueError):
    """An unknown policy name or a bad policy parameter (raised here and by
    :mod:`kvstrata.logical.policy`)."""


class AdmissionPolicy:
    """Decides whether a block offered to a tier is admitted there."""

    name = "always"
    learns_from_requests = False
    """True if the filter must be shown each request (:meth:`observe_request`)."""
    keeps_prefixes = False
    """True if the tier must take no block without its parent (in the tier, or taken just
    before it in the same offer): the planner then refuses such blocks too."""

    def observe_request(self, sequence_hashes: Sequence[int]) -> None:
        """A request's block hashes, from its first block, before its blocks are offered;
        only filters that set ``learns_from_requests`` use them."""

    def admit(self, sequence_hash: int) -> bool:
        return True

    def admit_many(self, sequence_hashes: Sequence[int]) -> list[bool]:
        """:meth:`admit` of each, in order (a filter may do a batch faster)."""
        return [self.admit(h) for h in sequence_hashes]


class SecondOfferAdmission(AdmissionPolicy):
    """Admit a block only the second time it is offered (Dynamo's disk filter).

    The first offer is remembered in a bounded FIFO history of ``history`` hashes (default:
    four times the tier's capacity), so a block offered once long ago is forgotten.
    One-hit blocks thus never displace blocks that were needed twice.
    """

    name = "second-offer"

    def __init__(self, capacity: int, history: int | None = None) -> None:
        size = history if history is not None else 4 * capacity
        if size <= 0:
            raise PolicyError(f"second-offer history must be positive, got {size}")
        self._size = size
        self._seen: OrderedDict[int, None] = OrderedDict()

    def admit(self, sequence_hash: int) -> bool:
        seen = self._seen
        if sequence_hash in seen:
            del seen[sequence_hash]
            return True
        seen[sequence_hash] = None
        if len(seen) > self._size:
            seen.popitem(last=False)
        return False
