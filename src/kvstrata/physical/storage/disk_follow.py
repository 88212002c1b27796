"""The journal of a durable disk tier that another process writes, followed read-only.

Some blocks are the same on several ranks: an MLA model's latent KV is replicated on every
tensor-parallel rank, and SGLang backs it up from one rank only. Those ranks keep one copy:
one rank writes its durable G3 (:meth:`~.disk.DiskStorage.durable`), the others read it in
place (:meth:`~.disk.DiskStorage.follow`), and learn what it holds from its index journal
(:mod:`.disk_index`), which this module reads as it grows and never writes.

:meth:`FollowedJournal.refresh` reads the records appended since the last call and applies
them in order, as the writer's own replay would (a ``FREE`` empties a slot, a ``PUT`` fills it
and supersedes an older slot naming the same block). When the journal file was replaced (the
writer compacted it or restarted) or shrank, it is read again from the start.

Why a view that is always a little stale is safe: the writer journals a ``FREE`` before it
overwrites a slot and a ``PUT`` only after the bytes landed, and every block a follower reads
is checked against the checksum (and keyed tag) of the record it read. A block overwritten
since the last refresh fails that check and is reported missing; it is never served as the
block it replaced. A record cut short or damaged is skipped (the last one of a read is left
for the next refresh: its write may still be under way).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import StorageConfigError
from .disk_home import private_file
from .disk_index import (_FREE, _HAS_PARENT, _HEADER, _PUT, _RECORD_DTYPE, RECORD_BYTES,
                         DiskIndex, LiveEntries, _sound)

__all__ = ["FollowedJournal"]

_READ_CHUNK = 64 << 20
"""Bytes of journal read per ``pread`` (a long journal is read in several)."""


class FollowedJournal(DiskIndex):
    """Another process's disk-tier journal at ``path``, read-only; see the module docstring.
    Its live entries are :class:`DiskIndex`'s (``live()``, ``len()``); :meth:`slot_of` finds
    a block. Thread-safe."""

    def __init__(self, path: str | os.PathLike, *, capacity: int, fingerprint: str,
                 stride: int, key_id: int = 0) -> None:
        super().__init__(Path(path), -1, capacity, fingerprint, stride, False, key_id)
        self._file: tuple[int, int] | None = None
        """(device, inode) of the journal file read so far."""
        self._offset: int | None = 0
        """Bytes of it applied; None: its header is not ours (nothing of it is applied)."""
        self._by_sequence: dict[int, int] = {}
        self.problem = "not read yet"
        """Why nothing is followed ("" while the journal is read)."""

    def slot_of(self, sequence_hash: int) -> int | None:
        """The slot the block ``sequence_hash`` is in, as of the last :meth:`refresh`."""
        return self._by_sequence.get(sequence_hash)

    def entries_at(self, slots: np.ndarray) -> LiveEntries:
        """The entries of those of ``slots`` that hold a block."""
        with self._lock:
            slots = slots[self._valid[slots]]
            return LiveEntries(slots, self._seq[slots].copy(), self._parent[slots].copy(),
                               self._has_parent[slots].copy(), self._local[slots].copy(),
                               self._checksum[slots].copy(), self._tag[slots].copy(),
                               self._seal[slots].copy())

    def refresh(self) -> np.ndarray:
        """Apply what the writer journaled since the last call; returns the slots whose
        entry changed (emptied, replaced or filled). Raises ``StorageConfigError`` when the
        journal cannot be trusted (not private to this user) or was kept under another key."""
        with self._lock:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                self.problem = "no journal yet"
                self._file, self._offset = None, 0
                return self._forget_all()
            except OSError as exc:
                raise StorageConfigError(f"cannot read the disk tier index {self.path}: "
                                         f"{exc.strerror or exc}") from exc
            try:
                private_file(fd, self.path, tighten=False)
                info = os.fstat(fd)
                identity = (info.st_dev, info.st_ino)
                fresh = identity != self._file or (
                    self._offset is not None and info.st_size < self._offset)
                changed = [self._forget_all()] if fresh else []
                if fresh:
                    self._file, self._offset = None, None
                    self.problem = self._check_header(os.pread(fd, _HEADER.size, 0))
                    self._file = identity
                    self._offset = None if self.problem else _HEADER.size
                if self._offset is not None and info.st_size > self._offset:
                    changed.append(self._read(fd, info.st_size, replay=fresh))
            except OSError as exc:
                raise StorageConfigError(f"cannot read the disk tier index {self.path}: "
                                         f"{exc.strerror or exc}") from exc
            finally:
                os.close(fd)
            return np.unique(np.concatenate(changed)) if changed else np.zeros(0, np.int64)

    # ------------------------------------------------------------------ reading
    def _read(self, fd: int, size: int, replay: bool) -> np.ndarray:
        """Apply the whole records from the offset to ``size``; all of them at once through
        the writer's own replay when the journal is read from the start."""
        end = self._offset + (size - self._offset) // RECORD_BYTES * RECORD_BYTES
        parts = []
        at = self._offset
        while at < end:
            chunk = os.pread(fd, min(_READ_CHUNK, end - at), at)
            if not chunk:
                break
            parts.append(chunk)
            at += len(chunk)
        body = b"".join(parts)
        body = body[:len(body) // RECORD_BYTES * RECORD_BYTES]
        records = np.frombuffer(body, dtype=_RECORD_DTYPE)
        good = _sound(body, records)
        if len(records) and not good[-1]:
            # the last record may be a write still under way: read it again next time
            records, good, body = records[:-1], good[:-1], body[:-RECORD_BYTES]
        self._offset += len(body)
        if replay:
            self._replay(body)
            slots = np.flatnonzero(self._valid)
            self._by_sequence = dict(zip(self._seq[slots].tolist(), slots.tolist()))
            self._records = len(records)
            return slots
        return self._apply(records[good])

    def _apply(self, records: np.ndarray) -> np.ndarray:
        """Apply sound ``records`` in order (see the module docstring); the slots changed."""
        changed = []
        for record in records:
            slot = int(record["slot"])
            if slot >= self.capacity:
                continue
            if self._valid[slot]:
                self._drop(slot)
                changed.append(slot)
            if record["op"] == _PUT:
                sequence_hash = int(record["seq"])
                older = self._by_sequence.get(sequence_hash)
                if older is not None:       # the block moved: its newest entry counts
                    self._drop(older)
                    changed.append(older)
                self._valid[slot] = True
                self._seq[slot] = record["seq"]
                self._parent[slot] = record["parent"]
                self._has_parent[slot] = (int(record["flags"]) & _HAS_PARENT) != 0
                self._local[slot] = record["local"]
                self._checksum[slot] = record["checksum"]
                self._tag[slot] = record["tag"]
                self._seal[slot] = record["seal"]
                self._order[slot] = self._records
                self._by_sequence[sequence_hash] = slot
                changed.append(slot)
            else:
                assert record["op"] == _FREE
            self._records += 1
        return np.asarray(changed, dtype=np.int64)

    def _drop(self, slot: int) -> None:
        self._valid[slot] = False
        sequence_hash = int(self._seq[slot])
        if self._by_sequence.get(sequence_hash) == slot:
            del self._by_sequence[sequence_hash]

    def _forget_all(self) -> np.ndarray:
        """Empty the view (the journal is gone or replaced); the slots that held blocks."""
        slots = np.flatnonzero(self._valid)
        self._valid[:] = False
        self._by_sequence = {}
        self._records = 0
        return slots

    # ------------------------------------------------------------------ never written here
    def free(self, slots) -> None:
        raise StorageConfigError(f"{self.path} is followed read-only: another process "
                                 f"writes it")

    def put(self, *args, **kwargs) -> None:
        raise StorageConfigError(f"{self.path} is followed read-only: another process "
                                 f"writes it")

    def close(self) -> None:
        """Nothing to close (no file is held between refreshes)."""
