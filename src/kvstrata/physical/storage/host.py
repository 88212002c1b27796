"""G2 host storage: one FullyContiguous region of host RAM, a block per slot.

``HostStorage(config)`` allocates ``num_blocks * block_stride`` bytes of page-aligned anonymous
memory, every page touched at creation so the data path never faults. When CUDA is present it
is also registered with CUDA (page-locked and mapped into the device's address space,
:class:`~kvstrata.physical.buffers.AlignedBuffer` with ``pin``): the device copy kernel reads
and writes the slots directly, and disk I/O with O_DIRECT still goes straight from/to a slot
(torch's pinned allocator would not keep it page aligned). Each block is contiguous, so moving
a block is one copy, and disk I/O can go straight from/to a slot when ``block_stride`` is a
multiple of 4096.

Integrity: the storage keeps a :class:`~kvstrata.physical.checksum.ChecksumTable`. Writers call
:meth:`HostStorage.begin_write` before and :meth:`HostStorage.seal` after putting bytes in a
slot; readers call :meth:`HostStorage.check_readable`, which checks the slot holds the
requested sequence hash and, when ``verify_reads`` is on, that its bytes still hash to the
recorded xxh3-64 (hashed on ``hash_threads`` threads: see :func:`default_hash_threads`).

When checksums are computed (``checksums=``):

* ``"eager"`` — every block is hashed as it is written into G2 (the G1->G2 copy hashes each
  block right behind the copy, while it is in cache). Needed to detect corruption *in G2*.
  From a GPU, through :class:`~kvstrata.physical.device_copy.DeviceCopyEngine`, what is
  recorded at write time is the block's *device checksum*, computed by the copy kernel; the
  xxh3 follows on first need, after the bytes were checked against the device checksum.
* ``"deferred"`` — a G1->G2 block is sealed without a checksum; it is hashed on first need:
  when it is written to G3 (the disk hashes it while the write runs, and the value is recorded
  here too), or by :meth:`HostStorage.ensure_checksums`. G3->G2 blocks carry the disk's
  verified checksum. Saves a hash pass over every offloaded byte.
* ``"auto"`` (default) — ``"eager"`` when ``verify_reads`` is on (verification needs the
  write-time checksum), else ``"deferred"``: with ``verify_reads`` off, a host read never
  compares bytes, so a write-time hash of G2 would protect nothing that is checked; the G3
  copy is protected from the moment it is written either way.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from ..buffers import AlignedBuffer, pinned_if_possible
from ..checksum import (ChecksumTable, block_checksum, memory_checksums,
                        memory_device_checksums)
from ..dtypes import torch_dtype
from ..errors import (BlockFailure, FailureKind, SlotPinnedError, StorageConfigError,
                      raise_for_failures)
from ...protocol.layout import FullyContiguousLayout, LayoutConfig
from ...protocol.layout_codec import StorageDescriptor
from .base import BlockMemory, MemoryStorage, StorageStatus

__all__ = ["HostStorage", "default_hash_threads"]


def default_hash_threads() -> int:
    """Threads that hash G2 blocks by default: one on a CPU-only host (its cores run the
    engine's forward); with CUDA, where the host's cores are mostly idle and the bytes move
    at PCIe speed (about 50 GB/s, several cores' worth of xxh3), up to 8, half the cores."""
    if not torch.cuda.is_available():
        return 1
    import os
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class HostStorage(MemoryStorage):
    """Host-RAM block pool (G2). ``pin=None`` pins (registers with CUDA) iff
    ``torch.cuda.is_available()``; ``hash_threads`` (default :func:`default_hash_threads`)
    hash a batch's blocks when verifying or sealing. ``buffer`` and ``table``: the slots'
    memory and checksum table, made by the caller (G2 shared between processes,
    :mod:`.host_shared`), instead of private ones."""

    kind = "host"
    keeps_checksums = True
    host_arrays = True

    def __init__(self, config: LayoutConfig, *, pin: bool | None = None,
                 verify_reads: bool = False, checksums: str = "auto",
                 hash_threads: int | None = None, buffer: AlignedBuffer | None = None,
                 table: ChecksumTable | None = None) -> None:
        if checksums not in ("auto", "eager", "deferred"):
            raise StorageConfigError(f"checksums must be 'auto', 'eager' or 'deferred', "
                                     f"got {checksums!r}")
        layout = FullyContiguousLayout(config)
        size = layout.region_bytes(0)
        if pin and not torch.cuda.is_available():
            raise StorageConfigError("pin=True needs CUDA (pin=None pins where CUDA is)")
        want_pin = torch.cuda.is_available() if pin is None else bool(pin)
        if buffer is not None and buffer.size < size:
            raise StorageConfigError(f"a buffer of {buffer.size} bytes cannot hold "
                                     f"{config.num_blocks} slots of {layout.block_stride}")
        self._buffer: AlignedBuffer | None = (
            buffer if buffer is not None
            else pinned_if_possible(size) if want_pin else AlignedBuffer(size))
        self.pinned = self._buffer.pinned
        region = self._buffer.tensor
        self.hash_threads = default_hash_threads() if hash_threads is None else max(1, hash_threads)
        super().__init__(BlockMemory(layout, (region,)))
        self._array = region.numpy()
        self.verify_reads = verify_reads
        self.checksum_mode = checksums
        self.checksums = ChecksumTable(config.num_blocks) if table is None else table
        self._pins: Counter[int] = Counter()
        self._pin_lock = threading.Lock()

    @property
    def eager_checksums(self) -> bool:
        """Whether blocks written into this storage are hashed at write time."""
        if self.checksum_mode == "auto":
            return bool(self.verify_reads)
        return self.checksum_mode == "eager"

    @property
    def block_stride(self) -> int:
        return self.layout.block_stride

    # -- raw access
    def block_array(self, block_id: int) -> np.ndarray:
        """The ``block_stride`` bytes of slot ``block_id`` as a numpy ``uint8`` view."""
        self._check_open()
        start = block_id * self.layout.block_stride
        return self._array[start:start + self.layout.block_stride]

    def payload(self, block_id: int) -> np.ndarray:
        """The ``block_bytes`` payload of slot ``block_id`` (no alignment padding)."""
        return self.block_array(block_id)[:self.config.block_bytes]

    def block_view(self, block_id: int) -> torch.Tensor:
        """Slot ``block_id`` as a typed tensor ``[num_layers, outer_dim, page_size, inner_dim]``."""
        cfg = self.config
        data = torch.from_numpy(self.payload(block_id))
        return data.view(torch_dtype(cfg.dtype)).view(cfg.num_layers, cfg.outer_dim, cfg.page_size,
                                               cfg.inner_dim)

    # -- integrity protocol
    def begin_write(self, block_ids: Sequence[int]) -> None:
        """Invalidate slots about to be overwritten; :class:`SlotPinnedError` (nothing
        invalidated) if another process is reading one of them (:meth:`pin_held`)."""
        with self._pin_lock:
            if self._pins:
                ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
                busy = ids[np.isin(ids, np.fromiter(self._pins, dtype=np.int64))].tolist()
                if busy:
                    raise SlotPinnedError(f"slots {busy[:4]} are being read by another "
                                          f"process; not overwritten")
            self.checksums.invalidate(block_ids)

    def forget(self, block_ids: Sequence[int]) -> None:
        """Slots ``block_ids`` no longer hold their blocks, for good (a reset, after new
        weights say): no read and no reader in another process (:meth:`pin_held`) is served
        from them until they are written again. A reader that pinned one before keeps
        reading the bytes it was promised."""
        with self._pin_lock:
            self.checksums.invalidate(block_ids)

    def pin_held(self, sequence_hashes: Sequence[int]) -> list[tuple[int, int, int]]:
        """For a reader in another process: the longest prefix of ``sequence_hashes`` held
        in valid slots, as ``(hash, slot, checksum)`` rows (deferred checksums computed
        now), each slot pinned against :meth:`begin_write` until :meth:`unpin`."""
        self._check_open()
        with self._pin_lock:
            valid = np.flatnonzero(self.checksums.valid_mask())
            seqs = self.checksums.sequence_hashes_of(valid)
            order = np.argsort(seqs, kind="stable")
            seqs, valid = seqs[order], valid[order]
            wanted = np.asarray(sequence_hashes, dtype=np.uint64)
            at = np.searchsorted(seqs, wanted)
            found = (at < len(seqs)) & (seqs[np.minimum(at, len(seqs) - 1)] == wanted) \
                if len(seqs) else np.zeros(len(wanted), dtype=bool)
            held = len(wanted) if found.all() else int(np.argmin(found))
            slots = valid[at[:held]].tolist()
            for slot in slots:
                self._pins[slot] += 1
        try:
            checksums, failures = self._xxh3_of(slots)
        except BaseException:
            self.unpin(slots)
            raise
        if failures:        # the prefix ends before the first block that failed its check
            cut = min(f.position for f in failures)
            self.unpin(slots[cut:])
            slots, checksums = slots[:cut], checksums[:cut]
        return list(zip(wanted[:len(slots)].tolist(), slots, checksums))

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Undo :meth:`pin_held` for these slots."""
        with self._pin_lock:
            for slot in block_ids:
                left = self._pins[slot] - 1
                if left > 0:
                    self._pins[slot] = left
                else:
                    self._pins.pop(slot, None)

    def seal(self, block_ids: Sequence[int], sequence_hashes: Sequence[int],
             checksums: Sequence[int | None] | None = None, *,
             defer: bool = False, device_sums: np.ndarray | None = None) -> list[int | None]:
        """Record slots as holding ``sequence_hashes``; hashes the bytes unless ``checksums``
        (already verified values) are given, or ``defer`` (leave missing checksums to be
        computed on first need). ``device_sums``: the device checksums the GPU copy kernel
        computed of the blocks' bytes (only with ``defer``). Returns the checksums (``None``
        where deferred)."""
        self._check_open()
        if defer:
            values = None if checksums is None else list(checksums)
            self.checksums.record_many(block_ids, values, sequence_hashes, device_sums)
            return values if values is not None else [None] * len(block_ids)
        if checksums is None:
            checksums = self.payload_checksums(block_ids).tolist()
        elif any(c is None for c in checksums):
            array, stride, nbytes = self._array, self.layout.block_stride, self.config.block_bytes
            checksums = [block_checksum(array[b * stride:b * stride + nbytes])
                         if checksums[i] is None else checksums[i]
                         for i, b in enumerate(block_ids)]
        checksums = list(checksums)
        self.checksums.record_many(block_ids, checksums, sequence_hashes)
        return checksums

    def ensure_checksums(self, block_ids: Sequence[int]) -> list[int]:
        """Checksums of valid slots, hashing (and recording) those not computed yet. A slot
        whose bytes no longer match its device checksum raises
        :class:`~kvstrata.physical.errors.ChecksumMismatchError` (and is invalidated)."""
        values, failures = self._xxh3_of(block_ids)
        raise_for_failures("G2 device checksum check", failures, len(block_ids))
        return values  # type: ignore[return-value]

    def _xxh3_of(self, block_ids: Sequence[int]) -> tuple[list[int | None], list[BlockFailure]]:
        """The xxh3 of each slot, hashing those not computed yet, and the failures of slots
        whose bytes fail their device checksum (``None`` values there; those slots are
        invalidated). The xxh3 is taken *before* the device check: a byte that changes after
        the hash is either caught by the check or differs from the recorded xxh3 at every
        later read, so no changed block is ever recorded under a checksum of its own."""
        self._check_open()
        values = self.checksums.checksums_of(block_ids)
        missing = [i for i, v in enumerate(values) if v is None]
        if not missing:
            return values, []
        slots = [block_ids[i] for i in missing]
        hashed = self.payload_checksums(slots).tolist()
        failures = self._check_device_sums(missing, slots)
        bad = {f.position for f in failures}
        if bad:
            self.checksums.invalidate([block_ids[p] for p in bad])
        keep = [k for k, i in enumerate(missing) if i not in bad]
        self.checksums.fill([slots[k] for k in keep], [hashed[k] for k in keep],
                            self.checksums.sequence_hashes_of(
                                [slots[k] for k in keep]).tolist())
        for k, i in enumerate(missing):
            values[i] = None if i in bad else hashed[k]
        return values, failures

    def device_sums_for_read(self, block_ids: Sequence[int],
                             sequence_hashes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(sums, known)``: the device checksums a GPU copy of these slots must produce,
        and where one is recorded (for slots :meth:`check_readable` passed without
        ``verify``). A storage another process writes answers from the writer's seals and
        expects :meth:`confirm_read` on the slots ``known`` after the copy."""
        return self.checksums.device_sums_of(block_ids)

    def check_readable(self, block_ids: Sequence[int], sequence_hashes: Sequence[int],
                       *, verify: bool | None = None) -> list[BlockFailure]:
        """Failures for slots that must not be read as ``sequence_hashes``; bytes are
        re-hashed when ``verify`` (default: the storage's ``verify_reads``)."""
        verify = self.verify_reads if verify is None else verify
        failures = self.checksums.check_identities(block_ids, sequence_hashes)
        if verify:
            ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
            passed = np.ones(ids.size, dtype=bool)
            passed[[f.position for f in failures]] = False
            positions = np.flatnonzero(passed)
            slots = ids[positions]
            by_device = self._device_summed(slots)
            if by_device.any():
                # xxh3 not known yet, device checksum known: hash, then check the device
                # checksum, and record the xxh3 of what passed (it travels on to G3)
                _, found = self._xxh3_of(slots[by_device])
                at = positions[by_device]
                failures += [replace(f, position=int(at[f.position])) for f in found]
                positions, slots = positions[~by_device], slots[~by_device]
            failures += self.checksums.compare(positions, slots, self.payload_checksums(slots))
            failures.sort(key=lambda f: f.position)
        return failures

    def _device_summed(self, slots: Sequence[int]) -> np.ndarray:
        """Per slot: its xxh3 is not computed yet but the GPU copy recorded a device
        checksum (bool array)."""
        _, device_known = self.checksums.device_sums_of(slots)
        if not device_known.any():
            return device_known
        return device_known & np.array([v is None for v in self.checksums.checksums_of(slots)])

    def _check_device_sums(self, positions: list[int], slots: list[int]) -> list[BlockFailure]:
        """Failures of the slots (at batch ``positions``) whose recorded device checksum no
        longer matches their bytes; slots without one are not checked here."""
        expected, known = self.checksums.device_sums_of(slots)
        if not known.all():
            keep = np.flatnonzero(known).tolist()
            positions = [positions[i] for i in keep]
            slots = [slots[i] for i in keep]
            expected = expected[known]
        if not slots:
            return []
        actual = memory_device_checksums(self._slot_addresses(slots), self.config.block_bytes,
                                         threads=self.hash_threads)
        return [BlockFailure(int(positions[i]), int(slots[i]), FailureKind.CHECKSUM_MISMATCH,
                             f"device checksum {int(actual[i]):#018x} != recorded "
                             f"{int(expected[i]):#018x}")
                for i in np.flatnonzero(actual != expected).tolist()]

    def payload_checksums(self, block_ids: Sequence[int]) -> np.ndarray:
        """The xxh3-64 of each slot's payload as it is now (``uint64``), on
        ``hash_threads`` threads."""
        return memory_checksums(self._slot_addresses(block_ids), self.config.block_bytes,
                                threads=self.hash_threads)

    def _slot_addresses(self, block_ids: Sequence[int]) -> np.ndarray:
        """The address of each slot's first byte (``uint64``), ids checked against the pool
        before any memory is read through them."""
        self._check_open()
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.num_blocks):
            raise IndexError(f"slot id out of range [0, {self.config.num_blocks})")
        return self._buffer.address + ids.astype(np.uint64) * np.uint64(self.layout.block_stride)

    # -- description
    def status(self) -> StorageStatus:
        cfg = self.config
        return StorageStatus(kind=self.kind, blocks=cfg.num_blocks, block_bytes=cfg.block_bytes,
                             bytes=self.layout.region_bytes(0), pinned=self.pinned,
                             device="cpu")

    def descriptors(self) -> tuple[StorageDescriptor, ...]:
        region = self.memory.regions[0]
        return (StorageDescriptor("pinned" if self.pinned else "host", region.numel(),
                                  address=region.data_ptr()),)

    def close(self) -> None:
        if not self.closed:
            super().close()
            self._array = None
            if self._buffer is not None:
                self._buffer.unpin()
            self._buffer = None
