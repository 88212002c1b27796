"""Block checksums (xxh3-64 of a block's payload bytes) and the per-slot table that keeps them.

A storage that keeps checksums (host G2, disk G3) owns a :class:`ChecksumTable` with one
entry per slot: valid flag, xxh3-64 of the payload and the sequence hash of the block that was
written there. The integrity rule: a slot is *invalidated before* bytes are written into it and
*recorded only after* the write completed; a read is served only if the slot is valid, holds
the requested sequence hash and (when verifying) the bytes hash to the recorded value.

Entries are plain numpy scalars; distinct slots may be updated from different threads (the
logical layer never schedules two transfers on one slot at a time).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash

from .errors import BlockFailure, FailureKind

__all__ = ["block_checksum", "ChecksumTable"]


def block_checksum(data) -> int:
    """xxh3-64 (seed 0) of a bytes-like object (bytes, memoryview, contiguous numpy array)."""
    return xxhash.xxh3_64_intdigest(data)


class ChecksumTable:
    """Per-slot (valid, checksum, sequence hash) records for ``num_blocks`` slots."""

    def __init__(self, num_blocks: int) -> None:
        self._valid = np.zeros(num_blocks, dtype=bool)
        self._checksum = np.zeros(num_blocks, dtype=np.uint64)
        self._seq = np.zeros(num_blocks, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self._valid)

    def invalidate(self, slots: Sequence[int]) -> None:
        """Mark slots empty (call before writing new bytes into them)."""
        self._valid[np.asarray(slots, dtype=np.int64)] = False

    def record(self, slot: int, checksum: int, sequence_hash: int) -> None:
        """Mark ``slot`` valid, holding ``sequence_hash`` with payload hash ``checksum``."""
        self._checksum[slot] = checksum
        self._seq[slot] = sequence_hash
        self._valid[slot] = True

    def record_many(self, slots: Sequence[int], checksums: Sequence[int],
                    sequence_hashes: Sequence[int]) -> None:
        """:meth:`record` for a batch (vectorized)."""
        idx = np.asarray(slots, dtype=np.int64)
        self._checksum[idx] = np.asarray(checksums, dtype=np.uint64)
        self._seq[idx] = np.asarray(sequence_hashes, dtype=np.uint64)
        self._valid[idx] = True

    def check_identities(self, slots: Sequence[int],
                         sequence_hashes: Sequence[int]) -> list[BlockFailure]:
        """:meth:`check_identity` for a batch (vectorized); positions are batch indices."""
        idx = np.asarray(slots, dtype=np.int64)
        bad = ~self._valid[idx] | (self._seq[idx] != np.asarray(sequence_hashes, dtype=np.uint64))
        return [self.check_identity(int(p), int(idx[p]), sequence_hashes[p])
                for p in np.flatnonzero(bad)]

    def get(self, slot: int) -> tuple[int, int] | None:
        """``(checksum, sequence_hash)`` of a valid slot, else ``None``."""
        if not self._valid[slot]:
            return None
        return int(self._checksum[slot]), int(self._seq[slot])

    def check_identity(self, position: int, slot: int, sequence_hash: int) -> BlockFailure | None:
        """Failure record if ``slot`` is empty or holds another sequence hash, else ``None``."""
        entry = self.get(slot)
        if entry is None:
            return BlockFailure(position, slot, FailureKind.NOT_WRITTEN,
                                "slot holds no valid block")
        if entry[1] != sequence_hash:
            return BlockFailure(position, slot, FailureKind.HASH_MISMATCH,
                                f"slot holds sequence hash {entry[1]}, not {sequence_hash}")
        return None

    def check_bytes(self, position: int, slot: int, data) -> BlockFailure | None:
        """Failure record if ``data`` does not hash to the checksum recorded for ``slot``."""
        entry = self.get(slot)
        if entry is None:
            return BlockFailure(position, slot, FailureKind.NOT_WRITTEN,
                                "slot holds no valid block")
        actual = block_checksum(data)
        if actual != entry[0]:
            return BlockFailure(position, slot, FailureKind.CHECKSUM_MISMATCH,
                                f"xxh3-64 {actual:#018x} != recorded {entry[0]:#018x}")
        return None
