"""Block layouts: where the bytes of block ``b``, layer ``l``, K/V half ``o`` live.

A block holds ``[num_layers][outer_dim][page_size x inner_dim]`` elements; ``outer_dim`` is 2
(K and V) or 1 (MLA). A *chunk* is the ``page_size x inner_dim`` elements of one
``(block, layer, outer)``; every layout keeps a chunk contiguous, and differs in where chunks go:

* :class:`FullyContiguousLayout` — one region, order ``block, layer, outer``.
  ``outer_stride = page*inner*dtype_bytes``, ``layer_stride = outer_stride*outer_dim``,
  ``natural_block_stride = num_layers*layer_stride``,
  ``block_stride = align_up(natural_block_stride, alignment)``. Host and disk pools use it, so
  one block is one copy.
* :class:`LayerSeparateLayout` — one region per layer, as engines allocate KV tensors; in
  ``OUTER_CONTIGUOUS`` order a region is ``[outer][block][chunk]`` (vLLM's ``[2, num_blocks,
  ...]``), in ``BLOCK_CONTIGUOUS`` order ``[block][outer][chunk]`` (``[num_blocks, 2, ...]``).

Addressing: :meth:`Layout.region_of` maps ``(block, layer, outer)`` to a :class:`Region`
``(index, offset, length)`` in bytes; :meth:`Layout.pieces` does the same for a batch of
blocks at once (numpy), at a :class:`Granularity` the copy engines use to move bytes.

Two layouts can exchange blocks when :meth:`Layout.require_compatible` passes: same layers,
outer_dim, page_size, inner_dim and dtype (block counts and alignment may differ).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np

from ..dtypes import DtypeError, canonical_dtype, itemsize
from .errors import LayoutConfigError, LayoutMismatchError

__all__ = ["LayoutConfig", "Region", "Granularity", "LayerOrder", "Layout",
           "FullyContiguousLayout", "LayerSeparateLayout", "align_up"]


def align_up(value: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` that is >= ``value``."""
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class LayoutConfig:
    """Geometry of one pool's blocks. ``alignment`` (a power of two, bytes) pads the
    per-block stride; ``dtype`` is a name (see :mod:`kvstrata.dtypes`)."""

    num_blocks: int
    num_layers: int
    outer_dim: int
    page_size: int
    inner_dim: int
    dtype: str = "bfloat16"
    alignment: int = 1

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_layers", "page_size", "inner_dim", "alignment"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutConfigError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.outer_dim, bool) or self.outer_dim not in (1, 2):
            raise LayoutConfigError(
                f"outer_dim must be 2 (K,V) or 1 (MLA), got {self.outer_dim!r}")
        if self.alignment & (self.alignment - 1):
            raise LayoutConfigError(f"alignment must be a power of two, got {self.alignment}")
        try:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        except DtypeError as exc:
            raise LayoutConfigError(str(exc)) from None
        chunk = self.page_size * self.inner_dim * itemsize(self.dtype)
        object.__setattr__(self, "_chunk_bytes", chunk)   # hot on the data path: cache

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return itemsize(self.dtype)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one ``(block, layer, outer)`` chunk (= the FullyContiguous outer stride)."""
        return self._chunk_bytes  # type: ignore[attr-defined]

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of one block (``chunk_bytes * outer_dim``)."""
        return self.chunk_bytes * self.outer_dim

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block, all layers and K/V (the natural block stride)."""
        return self.layer_bytes * self.num_layers

    def with_blocks(self, num_blocks: int) -> "LayoutConfig":
        """A copy with another block count (e.g. for a staging buffer)."""
        return LayoutConfig(**{**asdict(self), "num_blocks": num_blocks})

    def with_alignment(self, alignment: int) -> "LayoutConfig":
        """A copy with another alignment."""
        return LayoutConfig(**{**asdict(self), "alignment": alignment})

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LayoutConfig":
        """Inverse of :meth:`to_dict`; unknown or missing keys raise ``LayoutConfigError``."""
        if not isinstance(data, dict):
            raise LayoutConfigError(f"layout config must be a dict, got {type(data).__name__}")
        fields = set(cls.__dataclass_fields__)
        unknown = set(data) - fields
        missing = {"num_blocks", "num_layers", "outer_dim", "page_size", "inner_dim"} - set(data)
        if unknown or missing:
            raise LayoutConfigError(f"layout config: unknown keys {sorted(unknown)}, "
                                    f"missing keys {sorted(missing)}")
        return cls(**data)


class Region(NamedTuple):
    """A byte range inside one memory region of a layout."""

    index: int
    offset: int
    length: int


class Granularity(enum.IntEnum):
    """Size of the contiguous pieces a block is moved in, coarsest first."""

    BLOCK = 0   # the whole block payload in one piece
    LAYER = 1   # one piece per layer (outer_dim chunks)
    CHUNK = 2   # one piece per (layer, outer)


class LayerOrder(str, enum.Enum):
    """Order of dimensions inside one LayerSeparate region."""

    OUTER_CONTIGUOUS = "outer_contiguous"   # [outer][block][chunk]
    BLOCK_CONTIGUOUS = "block_contiguous"   # [block][outer][chunk]


class Layout(ABC):
    """Maps ``(block, layer, outer)`` to bytes in one or more memory regions."""

    kind: str = ""

    def __init__(self, config: LayoutConfig) -> None:
        if not isinstance(config, LayoutConfig):
            raise LayoutConfigError(f"expected a LayoutConfig, got {type(config).__name__}")
        self.config = config

    # -- shape of the memory
    @property
    @abstractmethod
    def num_regions(self) -> int:
        """Number of separate memory regions."""

    @abstractmethod
    def region_bytes(self, index: int) -> int:
        """Size in bytes of region ``index``."""

    @property
    def total_bytes(self) -> int:
        """Bytes over all regions."""
        return sum(self.region_bytes(i) for i in range(self.num_regions))

    @property
    @abstractmethod
    def contiguous_granularity(self) -> Granularity:
        """Coarsest granularity at which every piece of a block is contiguous."""

    # -- addressing
    @abstractmethod
    def _offsets(self, blocks: np.ndarray, layers: np.ndarray,
                 outers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorized (region index, byte offset) of chunks; arguments broadcast."""

    def region_of(self, block: int, layer: int, outer: int) -> Region:
        """Region index, byte offset and length of one chunk."""
        cfg = self.config
        for name, value, bound in (("block", block, cfg.num_blocks),
                                   ("layer", layer, cfg.num_layers),
                                   ("outer", outer, cfg.outer_dim)):
            if not 0 <= value < bound:
                raise IndexError(f"{name} {value} out of range [0, {bound})")
        region, offset = self._offsets(np.asarray(block), np.asarray(layer), np.asarray(outer))
        return Region(int(region), int(offset), cfg.chunk_bytes)

    def piece_bytes(self, granularity: Granularity) -> int:
        """Length of one piece at ``granularity``."""
        cfg = self.config
        return {Granularity.BLOCK: cfg.block_bytes, Granularity.LAYER: cfg.layer_bytes,
                Granularity.CHUNK: cfg.chunk_bytes}[granularity]

    def pieces(self, block_ids: np.ndarray | list[int],
               granularity: Granularity) -> tuple[np.ndarray, np.ndarray]:
        """``(region_index, offset)`` arrays of shape ``[n, pieces_per_block]`` for a batch.

        ``granularity`` must not be coarser than :attr:`contiguous_granularity`.
        """
        if granularity < self.contiguous_granularity:
            raise ValueError(f"{self.kind} blocks are not contiguous at {granularity.name}")
        cfg = self.config
        b = np.asarray(block_ids, dtype=np.int64).reshape(-1, 1, 1)
        if b.size and (b.min() < 0 or b.max() >= cfg.num_blocks):
            raise IndexError(f"block id out of range [0, {cfg.num_blocks})")
        layers = np.arange(cfg.num_layers if granularity >= Granularity.LAYER else 1)
        outers = np.arange(cfg.outer_dim if granularity == Granularity.CHUNK else 1)
        region, offset = self._offsets(b, layers.reshape(1, -1, 1), outers.reshape(1, 1, -1))
        full = (b.shape[0], layers.size, outers.size)
        flat = (b.shape[0], layers.size * outers.size)
        return (np.broadcast_to(region, full).reshape(flat),
                np.broadcast_to(offset, full).reshape(flat))

    # -- compatibility
    def require_compatible(self, other: "Layout") -> None:
        """Raise :class:`LayoutMismatchError` unless blocks can be copied to/from ``other``."""
        a, b = self.config, other.config
        diffs = [f"{name}: {getattr(a, name)!r} != {getattr(b, name)!r}"
                 for name in ("num_layers", "outer_dim", "page_size", "inner_dim", "dtype")
                 if getattr(a, name) != getattr(b, name)]
        if diffs:
            raise LayoutMismatchError("layouts differ in " + "; ".join(diffs))

    def describe(self) -> dict[str, Any]:
        """Plain-JSON description (kind, order, config) — see :mod:`.layout_codec`."""
        return {"kind": self.kind, "config": self.config.to_dict()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.describe() == other.describe()

    def __hash__(self) -> int:
        return hash(repr(self.describe()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


class FullyContiguousLayout(Layout):
    """One region; block ``b`` starts at ``b * block_stride`` and is contiguous."""

    kind = "fully_contiguous"

    @property
    def outer_stride(self) -> int:
        return self.config.chunk_bytes

    @property
    def layer_stride(self) -> int:
        return self.config.layer_bytes

    @property
    def natural_block_stride(self) -> int:
        return self.config.block_bytes

    def __init__(self, config: LayoutConfig) -> None:
        super().__init__(config)
        self._block_stride = align_up(config.block_bytes, config.alignment)

    @property
    def block_stride(self) -> int:
        """Distance between consecutive blocks (natural stride padded to ``alignment``)."""
        return self._block_stride

    @property
    def num_regions(self) -> int:
        return 1

    def region_bytes(self, index: int) -> int:
        if index != 0:
            raise IndexError(f"region {index} out of range [0, 1)")
        return self.config.num_blocks * self.block_stride

    @property
    def contiguous_granularity(self) -> Granularity:
        return Granularity.BLOCK

    def _offsets(self, blocks, layers, outers):
        offset = blocks * self.block_stride + layers * self.layer_stride + outers * self.outer_stride
        return np.zeros_like(offset), offset


class LayerSeparateLayout(Layout):
    """One region per layer, in either :class:`LayerOrder`. ``alignment`` pads the stride of
    the innermost repeated unit (a chunk in OUTER_CONTIGUOUS order, a block's K/V pair in
    BLOCK_CONTIGUOUS order)."""

    kind = "layer_separate"

    def __init__(self, config: LayoutConfig,
                 order: LayerOrder | str = LayerOrder.OUTER_CONTIGUOUS) -> None:
        super().__init__(config)
        try:
            self.order = LayerOrder(order)
        except ValueError:
            raise LayoutConfigError(f"unknown layer order {order!r}; expected one of "
                                    f"{[o.value for o in LayerOrder]}") from None

    @property
    def block_stride(self) -> int:
        """Distance between consecutive blocks inside a region."""
        cfg = self.config
        if self.order is LayerOrder.OUTER_CONTIGUOUS:
            return align_up(cfg.chunk_bytes, cfg.alignment)
        return align_up(cfg.layer_bytes, cfg.alignment)

    @property
    def outer_stride(self) -> int:
        """Distance between the K and V chunk of one block inside a region."""
        if self.order is LayerOrder.OUTER_CONTIGUOUS:
            return self.block_stride * self.config.num_blocks
        return self.config.chunk_bytes

    @property
    def num_regions(self) -> int:
        return self.config.num_layers

    def region_bytes(self, index: int) -> int:
        if not 0 <= index < self.config.num_layers:
            raise IndexError(f"region {index} out of range [0, {self.config.num_layers})")
        return self.config.num_blocks * self.block_stride * (
            self.config.outer_dim if self.order is LayerOrder.OUTER_CONTIGUOUS else 1)

    @property
    def contiguous_granularity(self) -> Granularity:
        if self.order is LayerOrder.BLOCK_CONTIGUOUS or self.config.outer_dim == 1:
            return Granularity.LAYER
        return Granularity.CHUNK

    def _offsets(self, blocks, layers, outers):
        offset = blocks * self.block_stride + outers * self.outer_stride
        region = layers + np.zeros_like(offset)
        return region, offset + np.zeros_like(region)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "order": self.order.value, "config": self.config.to_dict()}
