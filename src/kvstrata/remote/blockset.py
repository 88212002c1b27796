"""Block sets: a worker's exported block memory, described so another process can read it.

A *block set* says everything a reader needs and nothing it must trust blindly: the exporter's
name (its NIXL agent), which tier it exports, the layout of that tier's blocks with the
address, size, memory kind and device of each region (:mod:`kvstrata.protocol.layout_codec`),
the NIXL agent's metadata (how to reach its memory), the address of its lease service, and
the fingerprint of what the blocks were computed for (model, geometry, rank; see
:mod:`kvstrata.compat`). Wire form, JSON::

    {"format": "kvstrata.blockset", "version": 1, "name": str, "tier": "G2",
     "layout": <kvstrata.layout version 1>, "agent_metadata": base64, "control": "tcp://h:p",
     "fingerprint": str}

:func:`decode` validates everything before anything is used: size, format, version, keys and
types, the layout (its own validation), memory regions only (a file is not remote memory),
``address + size`` within 64 bits, a sane control address. :meth:`BlockSet.require_compatible`
refuses a block set whose blocks differ from the importer's in geometry, dtype or page size
(block counts and alignment may differ: blocks are copied one payload at a time), and
:meth:`BlockSet.block_ranges` only ever yields byte ranges inside the exported regions.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..protocol import layout_codec
from ..protocol.errors import LayoutError, LayoutVersionError
from ..protocol.layout import Granularity, Layout
from ..protocol.layout_codec import SharedLayout, StorageDescriptor
from .errors import BlockSetFormatError, BlockSetMismatchError, BlockSetVersionError

__all__ = ["FORMAT", "VERSION", "MAX_BYTES", "BlockSet", "decode", "byte_ranges"]

FORMAT = "kvstrata.blockset"
VERSION = 1
MAX_BYTES = 4 << 20
"""Largest serialized block set accepted (agent metadata is a few KiB)."""
_KEYS = {"format", "version", "name", "tier", "layout", "agent_metadata", "control",
         "fingerprint"}
_MEMORY = {"host", "pinned", "device"}
_CONTROL = re.compile(r"tcp://[A-Za-z0-9.\-\[\]:]{1,255}:[0-9]{1,5}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,255}")
_TIER = re.compile(r"G[1-4]")
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class BlockSet:
    """One exported tier of one worker (see the module docstring)."""

    name: str
    tier: str
    shared: SharedLayout
    agent_metadata: bytes
    control: str
    fingerprint: str = ""

    @property
    def layout(self) -> Layout:
        return self.shared.layout

    def encode(self) -> bytes:
        """The wire form (compact JSON, UTF-8)."""
        _check_fields(self.name, self.tier, self.control, self.fingerprint)
        _check_memory(self.shared)
        return json.dumps({
            "format": FORMAT, "version": VERSION, "name": self.name, "tier": self.tier,
            "layout": layout_codec.encode(self.shared.layout, self.shared.regions),
            "agent_metadata": base64.b64encode(self.agent_metadata).decode("ascii"),
            "control": self.control, "fingerprint": self.fingerprint},
            separators=(",", ":"), sort_keys=True).encode("utf-8")

    def require_compatible(self, local: Layout, fingerprint: str | None = None) -> None:
        """Raise :class:`BlockSetMismatchError` unless blocks of this set can be copied into
        ``local`` byte for byte (same layers, K/V, page size, inner dim, dtype), and, given
        the importer's ``fingerprint``, unless both were computed for the same thing."""
        try:
            self.layout.require_compatible(local)
        except LayoutError as exc:
            raise BlockSetMismatchError(f"block set {self.name!r}: {exc}") from None
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise BlockSetMismatchError(
                f"block set {self.name!r} was made for {self.fingerprint!r}, this worker is "
                f"{fingerprint!r}")

    def block_ranges(self, slots: Sequence[int],
                     granularity: Granularity | None = None) -> list[tuple[int, int]]:
        """``(address, length)`` of every piece of each slot's payload in the exporter's
        memory, block by block, pieces in payload order (layer, then K/V); one piece per
        block for a contiguous layout unless a finer ``granularity`` is asked."""
        return byte_ranges(self.shared, slots, granularity)


def byte_ranges(shared: SharedLayout, slots: Sequence[int],
                granularity: Granularity | None = None) -> list[tuple[int, int]]:
    """``(address, length)`` of the payload pieces of ``slots`` in ``shared``'s regions, at
    ``granularity`` (default: the coarsest the layout allows); a slot outside the layout is a
    :class:`BlockSetFormatError`."""
    layout = shared.layout
    ids = np.asarray(slots, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= layout.config.num_blocks):
        raise BlockSetFormatError(f"slots outside 0..{layout.config.num_blocks - 1}")
    granularity = max(layout.contiguous_granularity, granularity or Granularity.BLOCK)
    length = layout.piece_bytes(granularity)
    regions, offsets = layout.pieces(ids, granularity)
    bases = np.array([r.address for r in shared.regions], dtype=np.uint64)
    addresses = bases[regions.ravel()] + offsets.ravel().astype(np.uint64)
    return [(int(a), length) for a in addresses]


def decode(data: bytes | bytearray | memoryview | str, max_bytes: int = MAX_BYTES) -> BlockSet:
    """Validate and decode a serialized block set (see the module docstring)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BlockSetFormatError(f"a block set is bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise BlockSetFormatError(f"block set of {len(data)} bytes exceeds {max_bytes}")
    try:
        raw = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        # RecursionError: nesting deeper than the parser goes, e.g. b"[" * 100_000
        raise BlockSetFormatError(f"block set is not UTF-8 JSON (truncated?): "
                                  f"{type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(raw, dict):
        raise BlockSetFormatError("block set must be a JSON object")
    if raw.get("format") != FORMAT:
        raise BlockSetFormatError(f"format must be {FORMAT!r}, got {raw.get('format')!r:.40}")
    version = raw.get("version")
    if version != VERSION or isinstance(version, bool):
        raise BlockSetVersionError(f"block set version {version!r:.20} is not supported; this "
                                   f"build reads version {VERSION}")
    missing, unknown = _KEYS - set(raw), set(raw) - _KEYS
    if missing or unknown:
        raise BlockSetFormatError(f"block set: missing keys {sorted(missing)}, unknown keys "
                                  f"{sorted(unknown)[:5]}")
    for key in ("name", "tier", "agent_metadata", "control", "fingerprint"):
        if not isinstance(raw[key], str):
            raise BlockSetFormatError(f"block set: {key} must be a string")
    _check_fields(raw["name"], raw["tier"], raw["control"], raw["fingerprint"])
    try:
        shared = layout_codec.decode(raw["layout"])
    except LayoutVersionError as exc:
        raise BlockSetVersionError(f"block set layout: {exc}") from None
    except LayoutError as exc:
        raise BlockSetFormatError(f"block set layout: {exc}") from None
    _check_memory(shared)
    try:
        metadata = base64.b64decode(raw["agent_metadata"], validate=True)
    except (binascii.Error, ValueError):
        raise BlockSetFormatError("block set: agent_metadata is not base64") from None
    if not metadata:
        raise BlockSetFormatError("block set: agent_metadata is empty")
    return BlockSet(raw["name"], raw["tier"], shared, metadata, raw["control"],
                    raw["fingerprint"])


def _check_fields(name: Any, tier: Any, control: Any, fingerprint: Any) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BlockSetFormatError(f"block set: name {name!r:.60} is not a valid agent name")
    if not isinstance(tier, str) or not _TIER.fullmatch(tier):
        raise BlockSetFormatError(f"block set: tier {tier!r:.20} is not G1..G4")
    if not isinstance(control, str) or not _CONTROL.fullmatch(control) \
            or not 0 < int(control.rsplit(":", 1)[1]) < 65536:
        raise BlockSetFormatError(f"block set: control {control!r:.60} is not tcp://host:port")
    if not isinstance(fingerprint, str) or len(fingerprint) > 256:
        raise BlockSetFormatError("block set: fingerprint must be a string of <= 256 chars")


def _check_memory(shared: SharedLayout) -> None:
    for i, region in enumerate(shared.regions):
        if not isinstance(region, StorageDescriptor) or region.memory_kind not in _MEMORY:
            raise BlockSetFormatError(f"block set: region {i} is not memory "
                                      f"({getattr(region, 'memory_kind', None)!r})")
        if region.address + region.size > _U64 or region.address == 0:
            raise BlockSetFormatError(f"block set: region {i} at {region.address:#x} of "
                                      f"{region.size} bytes overflows the address space")
