"""What crosses a process boundary, importable without torch or prometheus_client.

* :mod:`.plans` -- :class:`TransferPlan` (job id, source and target :class:`Endpoint`, block
  ids or keys, sequence hashes);
* :mod:`.results` -- :class:`TransferResult`, :class:`BlockFailure`, :class:`FailureKind`;
* :mod:`.layout` and :mod:`.layout_codec` -- block geometry and addressing
  (:class:`LayoutConfig`, the layouts) and their versioned serialized form;
* :mod:`.errors` -- the typed errors of all of the above.

A scheduler process plans with these types and its worker processes execute them; both
validate what they receive (``from_dict`` / ``decode``) and raise a typed error naming the
problem.
"""

from .errors import (EngineBusyError, EngineClosedError, LayoutConfigError, LayoutError,
                     LayoutFormatError, LayoutMismatchError, LayoutVersionError, PhysicalError,
                     TransferError, TransferPlanError)
from .layout import (FullyContiguousLayout, Granularity, LayerOrder, LayerSeparateLayout, Layout,
                     LayoutConfig, Region, align_up)
from .layout_codec import SharedLayout, StorageDescriptor
from .plans import PLAN_VERSION, Endpoint, TransferPlan
from .results import BlockFailure, FailureKind, TransferResult

__all__ = ["EngineBusyError", "EngineClosedError", "LayoutConfigError", "LayoutError",
           "LayoutFormatError", "LayoutMismatchError", "LayoutVersionError", "PhysicalError",
           "TransferError", "TransferPlanError", "FullyContiguousLayout", "Granularity",
           "LayerOrder", "LayerSeparateLayout", "Layout", "LayoutConfig", "Region", "align_up",
           "SharedLayout", "StorageDescriptor", "PLAN_VERSION", "Endpoint", "TransferPlan",
           "BlockFailure", "FailureKind", "TransferResult"]
