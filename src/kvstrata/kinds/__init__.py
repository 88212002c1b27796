"""Tier kinds: one module per kind of memory a tier can live in, holding everything about it.

Each module (``device``, ``host``, ``disk``, ``object_store``) defines ``KIND``, a
:class:`~.base.Kind` that says, for its kind of tier: how its storage is built from the
config, what it recovers at start, whether it fits this machine (checked before anything is
allocated), what the cost model assumes of it before a copy was measured, and which storage
class carries its bytes. The transfer engine derives its copy paths from what the storage
classes can do (:mod:`kvstrata.physical.transfer`), so giving a kind a backend is one module
here: it is found by :data:`KINDS` without being listed anywhere.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..placement.costs import CostPrior
from ..tiers import TierKind, spec
from .base import Kind, StorageOptions, Storages, TierSetupError

__all__ = ["KINDS", "Kind", "kind_of", "cost_priors", "StorageOptions", "Storages",
           "TierSetupError", "build_storages", "check_tiers", "peek_recovered"]


def _discover() -> dict[TierKind, Kind]:
    found: dict[TierKind, Kind] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith("_") or module.name in ("base", "build"):
            continue
        kind = getattr(importlib.import_module(f"{__name__}.{module.name}"), "KIND", None)
        if isinstance(kind, Kind):
            if kind.kind in found:
                raise ImportError(f"two modules of kvstrata.kinds hold {kind.kind.value} tiers")
            found[kind.kind] = kind
    return found


KINDS: dict[TierKind, Kind] = _discover()
"""The kinds of tier kvstrata can hold bytes in, by :class:`~kvstrata.tiers.TierKind`."""


def kind_of(tier: str) -> Kind | None:
    """The :class:`Kind` of ``tier`` (None: no module holds its kind yet)."""
    return KINDS.get(spec(tier).kind)


def cost_priors() -> dict[TierKind, CostPrior]:
    """Every kind's cost prior, for :class:`~kvstrata.placement.costs.CostModel`."""
    return {kind: module.cost_prior for kind, module in KINDS.items()}


# after KINDS: build.py reads it
from .build import build_storages, check_tiers, peek_recovered  # noqa: E402
