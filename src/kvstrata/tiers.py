"""The tiers kvstrata knows, described once; every other module reads them from here.

A :class:`TierSpec` says what a tier *is*: its name, the kind of memory behind it, how its
blocks are addressed (fixed slots, or keys in a store shared with others), whether its blocks
outlive the process, and its place in the order (fastest first). Config validation, pools,
transfer plans, the transfer engine (a handler per pair of kinds), metrics and the event
formats all read these specs instead of spelling tier names, so a new kind of tier is one spec
here plus one storage backend.

======  ======  ==========  ==========  =================  ===========
tier    kind    addressing  persistent  Dynamo tier        vLLM medium
======  ======  ==========  ==========  =================  ===========
G1      device  slots       no          ``device``         ``GPU``
G2      host    slots       no          ``host_pinned``    ``CPU``
G3      disk    slots       yes         ``disk``           ``STORAGE``
G4      object  keys        yes         ``external``       ``REMOTE``
======  ======  ==========  ==========  =================  ===========

G1 is the engine's device memory (a CPU tensor stands in without a GPU); G2 host RAM owned by
kvstrata; G3 a slab file on local disk, kept with its index across restarts when it lives in
a configured directory (a temporary one is removed when its owner closes); G4 a store shared
by workers (an S3-compatible bucket), addressed by keys. Plans into a persistent tier carry
each block's identity (parent and local hash) so it can be stored with the block.

This module imports nothing from kvstrata.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["TierKind", "Addressing", "TierSpec", "TIERS", "TIER_NAMES", "TOP_TIER",
           "UnknownTierError", "spec", "first_of_kind", "order_of", "ordered", "path_name", "split_path",
           "is_onboard", "tier_of_router_name", "tier_of_vllm_medium"]


class TierKind(str, enum.Enum):
    """The memory behind a tier; the transfer engine picks a copy handler per pair of kinds."""

    DEVICE = "device"      # accelerator memory (the engine's KV tensors)
    HOST = "host"          # host RAM
    DISK = "disk"          # a local file
    OBJECT = "object"      # an object store (S3-compatible)
    REMOTE = "remote"      # another process's memory (e.g. over NIXL)


class Addressing(str, enum.Enum):
    """How plans name a tier's blocks."""

    SLOTS = "slots"        # block ids 0 .. capacity-1 of a storage this process owns
    KEYS = "keys"          # string keys in a store others may read and write too


@dataclass(frozen=True)
class TierSpec:
    """One tier: see the module docstring for the table of tiers."""

    name: str
    kind: TierKind
    addressing: Addressing
    persistent: bool
    order: int
    router_name: str
    """Dynamo KV router ``storage_tier`` value for this tier's events."""
    vllm_medium: str
    """vLLM KV event ``medium`` value for this tier's events."""
    summary: str
    default_blocks: int | None = None
    """Size (in blocks) of the tier in the default configuration; None: not configured by
    default. Small on purpose: at the default model geometry (128 KiB blocks) the defaults are
    128 MiB / 512 MiB / 2 GiB."""


TIERS: tuple[TierSpec, ...] = (
    TierSpec("G1", TierKind.DEVICE, Addressing.SLOTS, False, 0, "device", "GPU",
             "device memory: the engine's KV tensors", 1_000),
    TierSpec("G2", TierKind.HOST, Addressing.SLOTS, False, 1, "host_pinned", "CPU",
             "host RAM owned by kvstrata", 4_000),
    TierSpec("G3", TierKind.DISK, Addressing.SLOTS, True, 2, "disk", "STORAGE",
             "a slab file on local disk", 16_000),
    TierSpec("G4", TierKind.OBJECT, Addressing.KEYS, True, 3, "external", "REMOTE",
             "a store shared by workers, addressed by keys"),
)
"""Every tier, fastest first (``TIERS[i].order == i``)."""

TIER_NAMES: tuple[str, ...] = tuple(s.name for s in TIERS)
"""Tier names, fastest first."""

TOP_TIER: str = TIERS[0].name
"""The fastest tier: the engine's device memory, where blocks are computed and onboarded to."""

_BY_NAME = {s.name: s for s in TIERS}
_BY_ROUTER_NAME = {s.router_name: s.name for s in TIERS}
_BY_MEDIUM = {s.vllm_medium: s.name for s in TIERS}


class UnknownTierError(KeyError, ValueError):
    """A name that is not one of :data:`TIER_NAMES`."""

    def __init__(self, name: object) -> None:
        super().__init__(name)
        self.message = f"unknown tier {name!r}; tiers are {', '.join(TIER_NAMES)}"

    def __str__(self) -> str:
        return self.message


def spec(name: str) -> TierSpec:
    """The spec of tier ``name`` (:class:`UnknownTierError` if there is none)."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise UnknownTierError(name) from None


def first_of_kind(kind: TierKind) -> str:
    """The fastest tier of ``kind`` (e.g. the host tier that Dynamo's CPU cache size means)."""
    for s in TIERS:
        if s.kind is kind:
            return s.name
    raise UnknownTierError(kind.value)


def order_of(name: str) -> int:
    """Position of tier ``name`` in the order, 0 for the fastest."""
    return spec(name).order


def ordered(names) -> list[str]:
    """``names`` (known tiers) sorted fastest first, duplicates dropped."""
    return sorted(set(names), key=order_of)


def path_name(source: str, target: str) -> str:
    """The name of the path from ``source`` to ``target``, e.g. ``"G2->G1"``."""
    return f"{source}->{target}"


def split_path(path: str) -> tuple[str, str]:
    """Inverse of :func:`path_name` (both tiers checked)."""
    source, sep, target = str(path).partition("->")
    if not sep:
        raise ValueError(f"a path looks like 'G1->G2', got {path!r}")
    spec(source), spec(target)
    return source, target


def is_onboard(source: str, target: str) -> bool:
    """Whether moving a block from ``source`` to ``target`` brings it towards the engine."""
    return order_of(target) < order_of(source)


def tier_of_router_name(router_name: str) -> str | None:
    """The tier whose Dynamo ``storage_tier`` is ``router_name`` (None if none is)."""
    return _BY_ROUTER_NAME.get(router_name)


def tier_of_vllm_medium(medium: str) -> str | None:
    """The tier whose vLLM ``medium`` is ``medium`` (None if none is)."""
    return _BY_MEDIUM.get(medium)
