"""The storage interface shared by the device (G1), host (G2) and disk (G3) backends.

* :class:`Storage` — ``num_blocks`` slots of one :class:`~kvstrata.protocol.layout.Layout`;
  ``status()``, ``descriptors()`` / ``share()`` (layout + where it lives, see
  :mod:`~kvstrata.protocol.layout_codec`), ``close()``; a context manager.
* :class:`MemoryStorage` — a storage whose slots are addressable memory: ``memory`` is a
  :class:`BlockMemory` (the layout and one ``uint8`` tensor per region) that copy engines read
  and write directly.

Slot ids are the pool block ids of the tier (0..N-1). A storage never decides what a slot
holds; the logical layer does, and only registers a block after its transfer reported success.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ..checksum import ChecksumTable
from ..errors import StorageClosedError, StorageConfigError
from ...protocol.layout import Layout, LayoutConfig
from ...protocol.layout_codec import StorageDescriptor, encode

__all__ = ["BlockMemory", "Storage", "MemoryStorage", "StorageStatus", "byte_alias"]


def byte_alias(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A 1-D ``uint8`` tensor over ``nbytes`` of ``tensor``'s memory, starting at its first
    element (zero-copy; works for any dense stride order)."""
    alias = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    alias.set_(tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(),
               (nbytes,), (1,))
    return alias


@dataclass(frozen=True)
class BlockMemory:
    """Addressable memory of a layout: one ``uint8`` 1-D tensor per layout region."""

    layout: Layout
    regions: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if len(self.regions) != self.layout.num_regions:
            raise StorageConfigError(f"{self.layout.kind} layout needs "
                                     f"{self.layout.num_regions} regions, got {len(self.regions)}")
        devices = {r.device for r in self.regions}
        if len(devices) != 1:
            raise StorageConfigError(f"regions span several devices: {sorted(map(str, devices))}")
        for i, region in enumerate(self.regions):
            if region.dtype != torch.uint8 or region.dim() != 1 or not region.is_contiguous():
                raise StorageConfigError(f"region {i} must be a contiguous 1-D uint8 tensor")
            if region.numel() < self.layout.region_bytes(i):
                raise StorageConfigError(f"region {i} has {region.numel()} bytes, layout needs "
                                         f"{self.layout.region_bytes(i)}")

    @property
    def device(self) -> torch.device:
        return self.regions[0].device

    def base_addresses(self) -> np.ndarray:
        """Start address of every region (``int64`` array)."""
        return np.array([r.data_ptr() for r in self.regions], dtype=np.int64)


@dataclass(frozen=True)
class StorageStatus:
    """What a storage is and holds, for logs, metrics and tests."""

    kind: str                       # "device" | "host" | "disk"
    blocks: int                     # number of slots
    block_bytes: int                # payload bytes per block
    bytes: int                      # bytes allocated (memory or file size)
    pinned: bool = False            # host memory page-locked for DMA
    o_direct: bool = False          # disk opened with O_DIRECT
    stand_in: bool = False          # a CPU tensor standing in for device memory
    device: str = "cpu"
    path: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["notes"] = list(self.notes)
        return data


class Storage(ABC):
    """``num_blocks`` slots laid out by :attr:`layout`."""

    kind: str = ""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._closed = False
        self.checksums: ChecksumTable | None = None

    @property
    def config(self) -> LayoutConfig:
        return self.layout.config

    @property
    def num_blocks(self) -> int:
        return self.layout.config.num_blocks

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StorageClosedError(f"{self.kind} storage is closed")

    def check_block_ids(self, block_ids) -> None:
        """Raise ``IndexError`` if any id is outside ``[0, num_blocks)``."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise IndexError(f"{self.kind} block id out of range [0, {self.num_blocks})")

    @abstractmethod
    def status(self) -> StorageStatus:
        """Current :class:`StorageStatus`."""

    @abstractmethod
    def descriptors(self) -> tuple[StorageDescriptor, ...]:
        """One :class:`StorageDescriptor` per layout region."""

    def share(self) -> dict[str, Any]:
        """The layout and its descriptors, serialized (see :func:`layout_codec.encode`)."""
        return encode(self.layout, self.descriptors())

    def close(self) -> None:
        """Release memory/files. Idempotent."""
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MemoryStorage(Storage):
    """A storage whose slots copy engines can address directly through :attr:`memory`."""

    def __init__(self, memory: BlockMemory) -> None:
        super().__init__(memory.layout)
        self._memory = memory

    @property
    def memory(self) -> BlockMemory:
        self._check_open()
        return self._memory

    def close(self) -> None:
        super().close()
        self._memory = None
