"""Versioned serialization of a layout plus its storage descriptors, for sharing blocks
between processes (e.g. a worker telling a peer where its host pool or disk slab lives).

Wire form (plain JSON types)::

    {"format": "kvstrata.layout", "version": 1,
     "layout": {"kind": "fully_contiguous" | "layer_separate",
                "order": "outer_contiguous" | "block_contiguous",   # layer_separate only
                "config": {LayoutConfig fields}},
     "regions": [{"memory_kind": "host"|"pinned"|"device"|"disk",
                  "address": int|null, "path": str|null, "size": int,
                  "device_id": int|null}, ...]}                     # one per layout region

:func:`encode` / :func:`decode` work on that dict; :func:`to_json`, :func:`to_bytes` and
:func:`decode` (which also takes ``str``/``bytes``) handle text. Decoding validates everything
and raises :class:`~kvstrata.physical.errors.LayoutVersionError` for another version,
:class:`~kvstrata.physical.errors.LayoutFormatError` for anything malformed (naming the
field), and :func:`SharedLayout.require_matches` raises
:class:`~kvstrata.physical.errors.LayoutMismatchError` when a peer's layout differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import LayoutError, LayoutFormatError, LayoutMismatchError, LayoutVersionError
from .layout import FullyContiguousLayout, LayerSeparateLayout, Layout, LayoutConfig

__all__ = ["FORMAT", "VERSION", "MEMORY_KINDS", "StorageDescriptor", "SharedLayout",
           "encode", "decode", "to_json", "to_bytes"]

FORMAT = "kvstrata.layout"
VERSION = 1
MEMORY_KINDS = ("host", "pinned", "device", "disk")
_TOP_KEYS = {"format", "version", "layout", "regions"}
_REGION_KEYS = {"memory_kind", "address", "path", "size", "device_id"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StorageDescriptor:
    """Where one layout region lives: ``memory_kind``, an ``address`` (memory kinds) or a
    file ``path`` (disk), its ``size`` in bytes and the ``device_id`` (CUDA ordinal, device
    memory only)."""

    memory_kind: str
    size: int
    address: int | None = None
    path: str | None = None
    device_id: int | None = None

    def __post_init__(self) -> None:
        where = "storage descriptor"
        if self.memory_kind not in MEMORY_KINDS:
            raise LayoutFormatError(f"{where}: memory_kind {self.memory_kind!r} not in "
                                    f"{MEMORY_KINDS}")
        if not _is_int(self.size) or self.size < 0:
            raise LayoutFormatError(f"{where}: size must be a non-negative int, got {self.size!r}")
        if self.memory_kind == "disk":
            if not isinstance(self.path, str) or not self.path or self.address is not None:
                raise LayoutFormatError(f"{where}: disk regions need a path and no address")
        else:
            if not _is_int(self.address) or self.address < 0 or self.path is not None:
                raise LayoutFormatError(
                    f"{where}: {self.memory_kind} regions need an int address and no path")
        if self.device_id is not None and (not _is_int(self.device_id) or self.device_id < 0):
            raise LayoutFormatError(f"{where}: device_id must be a non-negative int or null")

    def to_dict(self) -> dict[str, Any]:
        return {"memory_kind": self.memory_kind, "address": self.address, "path": self.path,
                "size": self.size, "device_id": self.device_id}


@dataclass(frozen=True)
class SharedLayout:
    """A decoded layout and the descriptors of its regions."""

    layout: Layout
    regions: tuple[StorageDescriptor, ...]

    def require_matches(self, layout: Layout) -> None:
        """Raise :class:`LayoutMismatchError` unless ``layout`` is exactly this layout."""
        if layout != self.layout:
            layout.require_compatible(self.layout)   # names geometry/dtype differences first
            raise LayoutMismatchError(
                f"layouts differ: local {layout.describe()} != shared {self.layout.describe()}")


def encode(layout: Layout, regions: list[StorageDescriptor] | tuple[StorageDescriptor, ...]
           ) -> dict[str, Any]:
    """Serialize ``layout`` with one descriptor per region to a plain dict."""
    _check_regions(layout, regions)
    return {"format": FORMAT, "version": VERSION, "layout": layout.describe(),
            "regions": [r.to_dict() for r in regions]}


def to_json(layout: Layout, regions) -> str:
    """:func:`encode` as compact, key-sorted JSON text."""
    return json.dumps(encode(layout, regions), sort_keys=True, separators=(",", ":"))


def to_bytes(layout: Layout, regions) -> bytes:
    """:func:`to_json` as UTF-8 bytes."""
    return to_json(layout, regions).encode("utf-8")


def decode(data: dict[str, Any] | str | bytes) -> SharedLayout:
    """Validate and decode the output of :func:`encode`, :func:`to_json` or :func:`to_bytes`."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise LayoutFormatError(f"serialized layout is not UTF-8: {exc}") from None
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except (json.JSONDecodeError, RecursionError) as exc:   # nested too deep: Recursion
            raise LayoutFormatError(f"serialized layout is not JSON: "
                                    f"{type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(data, dict):
        raise LayoutFormatError(f"serialized layout must be an object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise LayoutFormatError(f"format must be {FORMAT!r}, got {data.get('format')!r}")
    version = data.get("version")
    if not _is_int(version):
        raise LayoutFormatError(f"version must be an int, got {version!r}")
    if version != VERSION:
        raise LayoutVersionError(f"unsupported layout format version {version}; "
                                 f"this build reads version {VERSION}")
    _check_keys("serialized layout", data, _TOP_KEYS)
    layout = _decode_layout(data["layout"])
    raw_regions = data["regions"]
    if not isinstance(raw_regions, list):
        raise LayoutFormatError("regions must be a list")
    regions = []
    for i, raw in enumerate(raw_regions):
        if not isinstance(raw, dict):
            raise LayoutFormatError(f"regions[{i}] must be an object")
        _check_keys(f"regions[{i}]", raw, _REGION_KEYS)
        try:
            regions.append(StorageDescriptor(**raw))
        except LayoutFormatError as exc:
            raise LayoutFormatError(f"regions[{i}]: {exc}") from None
    _check_regions(layout, regions)
    return SharedLayout(layout, tuple(regions))


def _check_keys(where: str, data: dict, expected: set[str]) -> None:
    missing, unknown = expected - set(data), set(data) - expected
    if missing or unknown:
        raise LayoutFormatError(f"{where}: missing keys {sorted(missing)}, "
                                f"unknown keys {sorted(unknown)}")


def _decode_layout(raw: Any) -> Layout:
    if not isinstance(raw, dict):
        raise LayoutFormatError("layout must be an object")
    kind = raw.get("kind")
    expected = {"kind", "config"} | ({"order"} if kind == "layer_separate" else set())
    _check_keys("layout", raw, expected)
    try:
        config = LayoutConfig.from_dict(raw["config"])
        if kind == "fully_contiguous":
            return FullyContiguousLayout(config)
        if kind == "layer_separate":
            return LayerSeparateLayout(config, raw["order"])
    except LayoutFormatError:
        raise
    except (LayoutError, TypeError) as exc:
        raise LayoutFormatError(f"layout: {exc}") from None
    raise LayoutFormatError(f"layout kind must be 'fully_contiguous' or 'layer_separate', "
                            f"got {kind!r}")


def _check_regions(layout: Layout, regions) -> None:
    if len(regions) != layout.num_regions:
        raise LayoutFormatError(f"{layout.kind} layout has {layout.num_regions} regions, "
                                f"got {len(regions)} descriptors")
    for i, region in enumerate(regions):
        if not isinstance(region, StorageDescriptor):
            raise LayoutFormatError(f"regions[{i}] is not a StorageDescriptor")
        if region.size < layout.region_bytes(i):
            raise LayoutFormatError(f"regions[{i}]: size {region.size} < the "
                                    f"{layout.region_bytes(i)} bytes the layout needs")
