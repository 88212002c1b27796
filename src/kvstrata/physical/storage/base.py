"""The storage interface every tier's backend implements; the transfer engine derives its
copy paths from which of the two kinds of storage each tier is.

* :class:`Storage` — blocks of one :class:`~kvstrata.protocol.layout.Layout`; ``kind`` names
  the kind of tier it serves (:class:`~kvstrata.tiers.TierKind`); ``status()``,
  ``descriptors()`` / ``share()`` (layout + where it lives, see
  :mod:`~kvstrata.protocol.layout_codec`), ``close()``; a context manager.
* :class:`MemoryStorage` — slots that are addressable memory (device memory, host RAM):
  ``memory`` is a :class:`BlockMemory` (the layout and one ``uint8`` tensor per region) that
  copy engines read and write directly. Its integrity hooks (:meth:`~MemoryStorage.check_readable`,
  :meth:`~MemoryStorage.begin_write`, :meth:`~MemoryStorage.seal`) do nothing unless the
  storage keeps checksums (host RAM does); with ``host_arrays`` every block is one host
  array (:meth:`~MemoryStorage.block_array`) a block store can read from or write into in
  place.
* :class:`BlockStore` — blocks read and written by batched calls through host buffers, by
  address (a slot id, or a key in a shared store): a disk slab, an object store. Two verbs,
  :meth:`~BlockStore.read_blocks` and :meth:`~BlockStore.write_blocks`, both verified.

Slot ids are the pool block ids of the tier (0..N-1). A storage never decides what a slot
holds; the logical layer does, and only registers a block after its transfer reported success.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ..checksum import ChecksumTable
from ..errors import BlockFailure, StorageClosedError, StorageConfigError
from ...protocol.layout import Layout, LayoutConfig
from ...protocol.layout_codec import StorageDescriptor, encode

__all__ = ["BlockMemory", "Storage", "MemoryStorage", "BlockStore", "StorageStatus",
           "byte_alias"]


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
    """A storage whose slots copy engines can address directly through :attr:`memory`.

    The integrity hooks below are what a copy into or out of it calls; here they do nothing
    (device memory keeps no checksums: what it holds is the engine's business once loaded).
    A storage that keeps checksums (:class:`~.host.HostStorage`) overrides them."""

    keeps_checksums: bool = False
    """Whether blocks copied in are sealed with their checksum (:meth:`seal`); such a
    storage has a ``checksums`` table and says whether it hashes at write time
    (``eager_checksums``) and re-hashes on every read (``verify_reads``)."""
    eager_checksums: bool = False
    verify_reads: bool = False
    written_elsewhere: bool = False
    """Whether another process writes these slots: a copy out of them is confirmed once it
    landed (:meth:`confirm_read`), and no store reads from them (what they hold is stored
    by the process that writes them)."""
    host_arrays: bool = False
    """Whether each block is one contiguous host array (:meth:`block_array`), which a
    :class:`BlockStore` reads from or writes into without a bounce buffer."""

    def __init__(self, memory: BlockMemory) -> None:
        super().__init__(memory.layout)
        self._memory = memory

    @property
    def memory(self) -> BlockMemory:
        self._check_open()
        return self._memory

    def check_readable(self, block_ids: Sequence[int],
                       sequence_hashes: Sequence[int]) -> list[BlockFailure]:
        """Failures of the slots that must not be read as ``sequence_hashes`` (none here)."""
        return []

    def confirm_read(self, block_ids: Sequence[int],
                     sequence_hashes: Sequence[int]) -> list[BlockFailure]:
        """After a copy out of slots that :meth:`check_readable` passed has landed: failures
        of those that changed meanwhile (none here: only a storage another process writes
        can change under a read)."""
        return []

    def forget_reads(self) -> None:
        """Drop what this thread remembered of the reads it checked for
        :meth:`confirm_read` (the transfer engine calls it after every plan out of this
        storage, however the plan ended: a copy that raised confirms nothing)."""

    def begin_write(self, block_ids: Sequence[int]) -> None:
        """Slots ``block_ids`` are about to be overwritten (nothing to invalidate here)."""

    def seal(self, block_ids: Sequence[int], sequence_hashes: Sequence[int],
             checksums: Sequence[int | None] | None = None, *,
             defer: bool = False) -> list[int | None]:
        """Slots ``block_ids`` now hold ``sequence_hashes``; returns their checksums (here
        the ones given, if any: nothing is recorded)."""
        return list(checksums) if checksums is not None else [None] * len(block_ids)

    def block_array(self, block_id: int) -> np.ndarray:
        """Slot ``block_id`` as one host ``uint8`` array (only where :attr:`host_arrays`)."""
        raise NotImplementedError(f"{self.kind} storage has no host array per block")

    def close(self) -> None:
        super().close()
        self._memory = None


class BlockStore(Storage):
    """A storage whose blocks are read and written in batches by address, through host
    buffers (see the module docstring). Addresses are slot ids ``0 .. num_blocks-1`` or, for
    a store addressed by keys, string keys. Both verbs fail per block: they raise a
    :class:`~kvstrata.physical.errors.BlockIOError` subclass whose ``failures`` name the
    positions that failed and whose ``checksums`` hold the others' values; every other block
    of the batch completed."""

    write_round: int | None = None
    """How many blocks one round of writes takes when writes are held back for the engine's
    forward (:class:`~kvstrata.physical.pacing.ForwardPacer`): a batch of requests that each
    wait at the gate (an object store's concurrent PUTs); None: a plan's writes wait once,
    as a whole."""

    @abstractmethod
    def read_blocks(self, addresses: Sequence, destinations: Sequence[np.ndarray],
                    sequence_hashes: Sequence[int]) -> list[int]:
        """Copy the blocks at ``addresses`` into ``destinations[i]`` (``uint8`` arrays of at
        least ``block_bytes``), each verified to be the block of ``sequence_hashes[i]`` with
        its recorded checksum; returns those checksums. A failed destination must not be
        used."""

    @abstractmethod
    def write_blocks(self, addresses: Sequence, sources: Sequence[np.ndarray],
                     sequence_hashes: Sequence[int], *,
                     checksums: Sequence[int | None] | None = None,
                     parent_hashes: Sequence[int | None] | None = None,
                     local_hashes: Sequence[int] | None = None) -> list[int]:
        """Store ``sources[i]`` as the block of ``sequence_hashes[i]`` at ``addresses[i]``;
        returns each block's xxh3-64. ``checksums`` (known values, ``None`` entries hashed
        here) are recorded as given, so a source whose bytes changed since fails when read
        back. ``parent_hashes`` / ``local_hashes`` are the blocks' identity, for a store
        that records it to recover the blocks after a restart."""
