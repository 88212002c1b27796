"""The journal of a durable disk tier that another process writes, followed read-only.

Some blocks are the same on several ranks: an MLA model's latent KV is replicated on every
tensor-parallel rank, and SGLang backs it up from one rank only. Those ranks keep one copy:
one rank writes its durable G3 (:meth:`~.disk.DiskStorage.durable`), the others read it in
place (:meth:`~.disk.DiskStorage.follow`), and learn what it holds from its index journal
(:mod:`.disk_index`), which this module reads as it grows and never writes.

:meth:`FollowedJournal.refresh` reads the records appended since the last call and applies
them in order, as the writer's own replay would (a ``FREE`` empties a slot, a ``PUT`` fills it
and supersedes an older slot naming the same block; the one difference: a block whose newer
slot is freed again is not found in its older one, a miss where the writer would still find
it). When the journal file was replaced (the writer compacted it or restarted) or shrank, it
is read again from the start. The journal read last is kept open, so its file cannot be
replaced by one that reuses its inode unnoticed. Records are read and applied
:data:`_READ_CHUNK` bytes at a time: a journal of any length takes bounded memory.

Why a view that is always a little stale is safe: the writer journals a ``FREE`` before it
overwrites a slot and a ``PUT`` only after the bytes landed, and every block a follower reads
is checked against the checksum (and keyed tag) of the record it read. A block overwritten
since the last refresh fails that check and is reported missing; it is never served as the
block it replaced. A record cut short or damaged is skipped (the last one of a read is left
for the next refresh: its write may still be under way). A block the follower found corrupt
is forgotten here (:meth:`FollowedJournal.forget_here`) until the writer journals its slot
again.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import StorageConfigError
from .disk_home import private_file
from .disk_index import (_HEADER, _PUT, _RECORD_DTYPE, RECORD_BYTES, last_per_slot,
                         DiskIndex, LiveEntries, _sound)

__all__ = ["FollowedJournal"]

_READ_CHUNK = 4 << 20
"""Bytes of journal read and applied at a time (a multiple of the record size is taken)."""


class FollowedJournal(DiskIndex):
    """Another process's disk-tier journal at ``path``, read-only; see the module docstring.
    Its live entries are :class:`DiskIndex`'s (``live()``, ``len()``); :meth:`slot_of` finds
    a block. Thread-safe."""

    def __init__(self, path: str | os.PathLike, *, capacity: int, fingerprint: str,
                 stride: int, key_id: int = 0) -> None:
        super().__init__(Path(path), -1, capacity, fingerprint, stride, False, key_id)
        self._offset: int | None = 0
        """Bytes of the open journal applied; None: its header is not ours (nothing of it is
        applied)."""
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

    def forget_here(self, slots) -> None:
        """Take ``slots`` out of this view (their blocks failed a check here) until the
        writer journals them again; the journal is not touched."""
        with self._lock:
            for slot in slots:
                if 0 <= slot < self.capacity and self._valid[slot]:
                    self._drop(int(slot))

    def refresh(self) -> np.ndarray:
        """Apply what the writer journaled since the last call; returns the slots whose
        entry changed (emptied, replaced or filled). Raises ``StorageConfigError`` when the
        journal cannot be trusted (not private to this user) or was kept under another key."""
        with self._lock:
            try:
                return self._refresh()
            except OSError as exc:
                raise StorageConfigError(f"cannot read the disk tier index {self.path}: "
                                         f"{exc.strerror or exc}") from exc

    def close(self) -> None:
        """Close the journal kept open. Idempotent."""
        with self._lock:
            self._close_file()

    # ------------------------------------------------------------------ reading
    def _refresh(self) -> np.ndarray:
        changed = []
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        held = os.fstat(self._fd) if self._fd >= 0 else None
        same = now is not None and held is not None and \
            (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino) and \
            (self._offset is None or now.st_size >= self._offset)
        if not same:                      # replaced, shrunk, gone, or never opened
            changed.append(self._forget_all())
            self._close_file()
            if now is None:
                self.problem = "no journal yet"
                return changed[0]
            self._open_file()
        if self._offset is not None:
            changed.extend(self._read_to_end())
        return np.unique(np.concatenate(changed)) if changed else np.zeros(0, np.int64)

    def _open_file(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            private_file(fd, self.path, tighten=False)
            self._offset = None
            problem = self._check_header(os.pread(fd, _HEADER.size, 0))
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.problem = problem
        self._offset = None if problem else _HEADER.size

    def _close_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _read_to_end(self) -> list[np.ndarray]:
        """Apply the whole records from the offset to the end, a chunk at a time."""
        changed = []
        size = os.fstat(self._fd).st_size
        chunk_bytes = max(1, _READ_CHUNK // RECORD_BYTES) * RECORD_BYTES
        while self._offset + RECORD_BYTES <= size:
            want = min(chunk_bytes, (size - self._offset) // RECORD_BYTES * RECORD_BYTES)
            body = os.pread(self._fd, want, self._offset)
            body = body[:len(body) // RECORD_BYTES * RECORD_BYTES]
            if not body:
                break
            records = np.frombuffer(body, dtype=_RECORD_DTYPE)
            good = _sound(body, records)
            last_chunk = self._offset + len(body) + RECORD_BYTES > size
            if last_chunk and not good[-1]:
                # the last record may be a write still under way: read it again next time
                records, good = records[:-1], good[:-1]
            self._offset += len(records) * RECORD_BYTES
            changed.append(self._apply(records[good]))
            self._records += len(records)
            if last_chunk:
                break
        return changed

    def _apply(self, records: np.ndarray) -> np.ndarray:
        """Apply sound ``records`` in order (see the module docstring), vectorized: each
        slot's last record decides what it holds; then a block put anew supersedes an older
        slot naming it. Returns the slots changed."""
        slots = records["slot"].astype(np.int64)
        last = last_per_slot(slots, self.capacity)  # each slot's last record, in order
        if not len(last):
            return np.zeros(0, np.int64)
        touched = slots[last]
        for slot in touched[self._valid[touched]].tolist():
            self._drop(slot)
        puts = last[records["op"][last] == _PUT]
        chosen = records[puts]
        where = self._set_entries(chosen, self._records + puts)
        superseded = []
        for slot, sequence_hash in zip(where.tolist(), chosen["seq"].tolist()):
            older = self._by_sequence.get(sequence_hash)
            if older is not None and older != slot and self._valid[older]:
                self._drop(older)               # the block moved: its newest entry counts
                superseded.append(older)
            self._by_sequence[sequence_hash] = slot
        return np.concatenate([touched, np.asarray(superseded, dtype=np.int64)])

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
