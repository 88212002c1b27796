"""Eviction and admission policies by name: what config strings turn into.

* eviction: ``lru``, ``default`` (Dynamo's order, leaves first), ``lfu`` (aged LFU with a
  ghost history) -- :mod:`kvstrata.logical.eviction`;
* admission: ``always``, ``second-offer`` -- :mod:`kvstrata.logical.admission`;
  ``predicted-reuse`` (refuses blocks of a kind that rarely returns, learned online) --
  :mod:`kvstrata.logical.reuse_prediction`;
* ``adaptive`` in either place: chosen online by set dueling -- :mod:`kvstrata.logical.adaptive`.

docs/configuration.md says what each does and docs/policies.md how they compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .adaptive import ADAPTIVE, build_adaptive
from .admission import AdmissionPolicy, PolicyError, SecondOfferAdmission
from .filters import ADMISSION_FILTERS
from .eviction import EVICTION_ORDERS, EvictionPolicy

__all__ = ["PolicyError", "ADAPTIVE", "EVICTION_NAMES", "ADMISSION_NAMES", "TierPolicies",
           "make_eviction", "make_admission", "make_tier_policies", "SecondOfferAdmission"]

EVICTION_NAMES = (*EVICTION_ORDERS, ADAPTIVE)
"""Every eviction policy name a config may use."""
ADMISSION_NAMES = (*ADMISSION_FILTERS, ADAPTIVE)
"""Every admission policy name a config may use."""


@dataclass
class TierPolicies:
    """A tier's eviction order and admission filter, and the duel choosing them if adaptive.

    ``observe_request`` is None unless a policy learns from requests; the planner calls it
    with each request's block hashes before serving the request.
    """

    eviction: EvictionPolicy
    admission: AdmissionPolicy
    observe_request: Callable[[Sequence[int]], None] | None = None


def make_eviction(name: str, capacity: int) -> EvictionPolicy:
    """Build the eviction policy called ``name`` for a pool of ``capacity`` blocks.

    ``adaptive`` builds one with its own duel; use :func:`make_tier_policies` to share the
    duel with the tier's admission filter and feed it requests.
    """
    return make_tier_policies(name, "always", capacity).eviction


def make_admission(name: str, capacity: int) -> AdmissionPolicy:
    """Build the admission policy called ``name`` for a tier of ``capacity`` blocks."""
    return make_tier_policies("lru", name, capacity).admission


def make_tier_policies(eviction: str, admission: str, capacity: int) -> TierPolicies:
    """Both policies of a tier; ``adaptive`` in either place makes them share one duel."""
    if eviction not in EVICTION_NAMES:
        raise PolicyError(f"unknown eviction policy {eviction!r}; choose one of "
                          f"{sorted(EVICTION_NAMES)}")
    if admission not in ADMISSION_NAMES:
        raise PolicyError(f"unknown admission policy {admission!r}; choose one of "
                          f"{sorted(ADMISSION_NAMES)}")
    if ADAPTIVE not in (eviction, admission):
        admit = ADMISSION_FILTERS[admission](capacity)
        return TierPolicies(EVICTION_ORDERS[eviction](capacity), admit,
                            admit.observe_request if admit.learns_from_requests else None)
    eviction_order, admission_filter, observe = build_adaptive(eviction, admission, capacity)
    return TierPolicies(eviction_order, admission_filter, observe)
