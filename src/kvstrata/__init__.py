"""kvstrata: a tiered KV-cache block manager for LLM inference.

The names a user needs are importable from here; each loads its module on first use, so
``import kvstrata`` is cheap and loads neither torch nor prometheus_client:

* :class:`KvBlockManager` -- one process: G1 device memory (or a CPU stand-in), G2 host RAM,
  G3 local disk, with background offload and verified onboard (needs torch);
* :class:`KvConfig`, :class:`TierConfig`, :class:`ModelGeometry`, :func:`load_config`,
  :class:`ConfigError` -- configuration (TOML, environment, Dynamo KVBM variables);
* :class:`Planner`, :class:`OnboardResult` -- the placement planner that replay, manager and
  engine connectors drive;
* :class:`TransferPlan`, :class:`TransferResult` -- what crosses a process boundary;
* :class:`BlockRecord`, :func:`hash_blocks` -- block identities and how prompts are hashed;
* :func:`replay` -- replay a Mooncake trace through the planner;
* ``TIERS`` -- the tier specs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "KvBlockManager": "kvstrata.manager",
    "ManagerError": "kvstrata.manager",
    "KvConfig": "kvstrata.config",
    "TierConfig": "kvstrata.config",
    "ModelGeometry": "kvstrata.config",
    "ConfigError": "kvstrata.config",
    "load_config": "kvstrata.config",
    "Planner": "kvstrata.placement",
    "OnboardResult": "kvstrata.placement",
    "TransferPlan": "kvstrata.protocol",
    "TransferResult": "kvstrata.protocol",
    "BlockRecord": "kvstrata.types",
    "hash_blocks": "kvstrata.tokens",
    "replay": "kvstrata.replay",
    "TIERS": "kvstrata.tiers",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from .config import ConfigError, KvConfig, ModelGeometry, TierConfig, load_config
    from .manager import KvBlockManager, ManagerError
    from .placement import OnboardResult, Planner
    from .protocol import TransferPlan, TransferResult
    from .replay import replay
    from .tiers import TIERS
    from .tokens import hash_blocks
    from .types import BlockRecord


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
