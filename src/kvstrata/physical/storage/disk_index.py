"""The index of a durable disk tier: which slot of the slab holds which block, as a journal.

(Over 500 lines on purpose: one concern, the disk tier's journal; its record format, write
order, replay and compaction make one crash-safety argument, spelled out below.)

The index is one append-only file of fixed-size records beside the slab. Writing a batch
of blocks is three steps, in this order:

1. ``FREE`` records for the slots about to be overwritten (one ``write``);
2. the block bytes into the slab;
3. ``PUT`` records for the blocks whose write succeeded (one ``write``): slot, sequence hash,
   parent hash, local hash, xxh3-64 of the payload, its keyed tag
   (:mod:`kvstrata.physical.tags`; 0 in an index kept without a key, or for an encrypted
   block) and, for a block stored encrypted, its seal (salt and GCM tag; zeros otherwise).

Whatever instant a process dies at, the index then names only blocks whose bytes were fully
written before their entry: a slot being overwritten was freed first, and a block whose bytes
never landed has no entry. (Surviving a power cut needs the data flushed before step 3 and
the journal after it: ``sync=True``.) Every record carries its own xxh3-64, so a record torn
by a crash (the tail of the file) or damaged later is dropped on recovery, never trusted; a
dropped ``FREE`` can only resurrect an entry whose bytes no longer match its checksum, and
every read of the slab verifies that checksum (which is what makes verification lazy: blocks
are checked when first served, not at start).

Records are written at the journal's record-aligned end. A write that fails part-way (a
full disk: ENOSPC, EDQUOT or EFBIG after a short write) keeps the whole records that landed
and cuts the file back to the last of them (a failed flush, with ``sync``, cuts off the whole
batch: none of it is known to be durable); the in-memory index counts exactly the records
kept, and :class:`JournalWriteError` names the slots whose records were not, so the caller
fails those blocks (a slot whose ``FREE`` was not kept still holds its block and must not be
written). Should the cut fail too, or take off whole records (which a follower may have
read), nothing is appended until the journal was rewritten from the in-memory index (as a
compaction does); until then every ``free`` and ``put`` fails.

:meth:`DiskIndex.open` replays the journal into a table of live entries (numpy arrays by
slot, about 40 bytes per slot), drops entries past the slab's capacity, keeps the newest of
two entries naming one block, and rewrites the journal compactly (written to a temporary
file, flushed, renamed over the old one). It is compacted again whenever it holds four times
more records than the slab has slots, so it stays bounded.

Record layout (88 bytes, little-endian): ``op u8, flags u8, pad u16, slot u32, sequence_hash
u64, parent_hash u64, local_hash u64, checksum u64, tag u64, seal 32 bytes, record_xxh3
u64``; ``flags`` bit 0 says the block has a parent. The file starts with a 64-byte header: magic, format version,
the compatibility fingerprint (:mod:`kvstrata.compat`), the block stride and the id of the
key the tags were made with (0: none). A journal of another version, fingerprint, stride or
key is not recovered: a journal kept without a key starts empty under one, and one kept with
a key is refused (:class:`StorageConfigError`) under another key or none, so a start with a
missing secret destroys nothing. The record's own xxh3 catches damage only; what
makes a forged record useless is the tag of its block, checked when the block is read.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import xxhash

from ..errors import StorageConfigError
from ...paths import write_all
from .disk_home import private_file

__all__ = ["DiskIndex", "IndexEntry", "JournalWriteError", "LiveEntries", "RecoveryReport",
           "INDEX_VERSION", "RECORD_BYTES"]

log = logging.getLogger(__name__)

INDEX_VERSION = 2
RECORD_BYTES = 88
_MAGIC = b"KVSTRATA-G3-IDX\0"
_HEADER = struct.Struct("<16sI16sQQ4xQ")   # magic, version, fingerprint, stride, key id, xxh3
_BODY = struct.Struct("<BBHIQQQQQ32s")             # the record without its own hash
_PUT, _FREE = 1, 2
_NO_SEAL = bytes(32)
_HAS_PARENT = 1
_COMPACT_FACTOR = 4
REPLAY_CHUNK = 1 << 18
"""Records read at once when a journal is replayed (22 MiB)."""
_RECORD_DTYPE = np.dtype([("op", "u1"), ("flags", "u1"), ("pad", "<u2"), ("slot", "<u4"),
                          ("seq", "<u8"), ("parent", "<u8"), ("local", "<u8"),
                          ("checksum", "<u8"), ("tag", "<u8"), ("seal", "u1", (32,)),
                          ("xxh", "<u8")])
assert _RECORD_DTYPE.itemsize == RECORD_BYTES and _BODY.size + 8 == RECORD_BYTES
assert _HEADER.size == 64


class JournalWriteError(OSError):
    """Records of one :meth:`DiskIndex.free` or :meth:`DiskIndex.put` did not reach the
    journal (its ``errno`` says why). ``unrecorded`` names their slots, which keep what the
    journal said of them before; the records before them landed and count."""

    def __init__(self, cause: OSError, unrecorded: Sequence[int]) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.unrecorded = list(unrecorded)


@dataclass(frozen=True)
class IndexEntry:
    """One live entry: ``slot`` holds the block ``sequence_hash`` (with ``parent_hash``,
    ``local_hash``) whose payload hashes to ``checksum``."""

    slot: int
    sequence_hash: int
    parent_hash: int | None
    local_hash: int
    checksum: int


@dataclass(frozen=True)
class LiveEntries:
    """Live entries as numpy columns (one row per block, oldest first): cheap for many."""

    slots: np.ndarray
    sequence_hashes: np.ndarray
    parent_hashes: np.ndarray
    has_parent: np.ndarray
    local_hashes: np.ndarray
    checksums: np.ndarray
    tags: np.ndarray
    """Keyed tags of the blocks (zeros in an index kept without a key)."""
    seals: np.ndarray
    """``(n, 32)`` seals of the blocks stored encrypted (rows of zeros for the others)."""

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self):
        return iter(self.entries())

    def rows(self) -> list[tuple[int, int, int | None, int]]:
        """(slot, sequence hash, parent hash or None, local hash) per entry."""
        parents = [p if has else None for p, has in zip(self.parent_hashes.tolist(),
                                                         self.has_parent.tolist())]
        return list(zip(self.slots.tolist(), self.sequence_hashes.tolist(), parents,
                        self.local_hashes.tolist()))

    def entries(self) -> list[IndexEntry]:
        return [IndexEntry(slot, seq, parent, local, checksum)
                for (slot, seq, parent, local), checksum
                in zip(self.rows(), self.checksums.tolist())]


@dataclass(frozen=True)
class RecoveryReport:
    """What :meth:`DiskIndex.open` found: live entries kept, and records dropped and why."""

    entries: int
    records: int
    torn_bytes: int = 0
    """Bytes of a partial record at the end (a write cut short by a crash), cut off."""
    corrupt_records: int = 0
    """Records whose own checksum failed (dropped)."""
    beyond_capacity: int = 0
    """Entries for slots the slab no longer has (it was configured smaller)."""
    duplicates: int = 0
    """Older entries for a block that a newer entry names in another slot."""
    fresh_reason: str = ""
    """Why nothing was recovered ("" if the journal was read): no journal, a bad header..."""


class DiskIndex:
    """The journal of one durable slab; see the module docstring. Thread-safe."""

    def __init__(self, path: Path, fd: int, capacity: int, fingerprint: str, stride: int,
                 sync: bool, key_id: int = 0) -> None:
        self.path = path
        self._fd = fd
        self.capacity = capacity
        self.fingerprint = fingerprint
        self.stride = stride
        self.key_id = key_id
        self.sync = sync
        self._lock = threading.Lock()
        self._valid = np.zeros(capacity, dtype=bool)
        self._seq = np.zeros(capacity, dtype=np.uint64)
        self._parent = np.zeros(capacity, dtype=np.uint64)
        self._has_parent = np.zeros(capacity, dtype=bool)
        self._local = np.zeros(capacity, dtype=np.uint64)
        self._checksum = np.zeros(capacity, dtype=np.uint64)
        self._tag = np.zeros(capacity, dtype=np.uint64)
        self._seal = np.zeros((capacity, 32), dtype=np.uint8)
        self._order = np.zeros(capacity, dtype=np.int64)   # record number of the entry
        self._records = 0
        self._end = 0
        """Bytes of the journal up to its last record kept: where the next one goes."""
        self._rewrite_due = False
        """The file holds bytes past ``_end`` that could not be cut off: rewrite it first."""
        self._compact_at = _COMPACT_FACTOR * max(capacity, 256)
        self.report = RecoveryReport(0, 0)

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str | os.PathLike, *, capacity: int, fingerprint: str, stride: int,
             sync: bool = False, key_id: int = 0) -> "DiskIndex":
        """Recover the journal at ``path`` (or start an empty one) and compact it. A journal
        written for another fingerprint, stride or tag key (``key_id``, 0: none), or with a
        damaged header, is replaced by an empty one (``report.fresh_reason`` says why)."""
        index = cls._load(Path(path), capacity, fingerprint, stride, sync, key_id=key_id)
        try:
            index._rewrite()
        except OSError as exc:
            raise StorageConfigError(f"cannot write the disk tier index {path}: "
                                     f"{exc.strerror or exc}") from exc
        return index

    @classmethod
    def peek(cls, path: str | os.PathLike, *, capacity: int, fingerprint: str,
             stride: int, key_id: int = 0) -> "LiveEntries | None":
        """What :meth:`open` would recover from ``path``, read without writing anything
        (another process may own the journal); None if there is no usable journal."""
        try:
            index = cls._load(Path(path), capacity, fingerprint, stride, False, peek=True,
                              key_id=key_id)
        except (OSError, StorageConfigError):
            return None
        return None if index.report.fresh_reason else index.live()

    @classmethod
    def _load(cls, path: Path, capacity: int, fingerprint: str, stride: int,
              sync: bool, peek: bool = False, key_id: int = 0) -> "DiskIndex":
        index = cls(path, -1, capacity, fingerprint, stride, sync, key_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            index.report = RecoveryReport(0, 0, fresh_reason="no index yet")
            return index
        except OSError as exc:
            raise StorageConfigError(f"cannot read the disk tier index {path}: "
                                     f"{exc.strerror or exc}") from exc
        try:
            private_file(fd, path, tighten=not peek)   # a peek changes nothing
            with os.fdopen(fd, "rb", closefd=False) as journal:
                header = journal.read(_HEADER.size)
                reason = index._check_header(header) if header else "empty index file"
                if not reason:
                    index._replay(journal)
        except OSError as exc:
            raise StorageConfigError(f"cannot read the disk tier index {path}: "
                                     f"{exc.strerror or exc}") from exc
        finally:
            os.close(fd)
        if reason:
            index.report = RecoveryReport(0, 0, fresh_reason=reason)
        return index

    def _check_header(self, raw: bytes) -> str:
        if len(raw) < _HEADER.size:
            return "index header is cut short"
        magic, version, fingerprint, stride, key_id, digest = _HEADER.unpack(raw)
        if magic != _MAGIC or digest != xxhash.xxh3_64_intdigest(raw[:-8]):
            return "index header is damaged"
        if version != INDEX_VERSION:
            return f"index format {version}, this build reads {INDEX_VERSION}"
        if fingerprint.rstrip(b"\0").decode("ascii", "replace") != self.fingerprint:
            return "index belongs to another fingerprint"
        if stride != self.stride:
            return f"index was written for {stride}-byte blocks, not {self.stride}"
        if key_id != self.key_id:
            if not key_id:                 # unkeyed blocks cannot be trusted under a key
                return "index was kept without a key"
            # One start with a missing or wrong secret must not wipe a G3 the right one
            # would serve: refused, the directory left as it is.
            now = "none is set now" if not self.key_id else "another one is set now"
            raise StorageConfigError(
                f"the disk tier in {self.path.parent} was kept with the deployment's secret "
                f"and {now}: start with the secret it was kept with, or remove that "
                f"directory to start it empty")
        return ""

    def _replay(self, journal) -> None:
        """Replay the records after the header, read ``REPLAY_CHUNK`` records at a time
        (the memory it takes is bounded whatever the journal's length)."""
        seen = corrupt = beyond = torn = 0
        while True:
            body = journal.read(REPLAY_CHUNK * RECORD_BYTES)
            whole = len(body) // RECORD_BYTES * RECORD_BYTES
            records = np.frombuffer(body, dtype=_RECORD_DTYPE, count=whole // RECORD_BYTES)
            good = _sound(body, records)
            numbers = np.flatnonzero(good) + seen        # record numbers in the journal
            seen += len(records)
            corrupt += int(len(records) - len(numbers))
            records = records[good]
            slots = records["slot"].astype(np.int64)
            beyond += int(((records["op"] == _PUT) & (slots >= self.capacity)).sum())
            # The last record naming a slot decides what it holds (a PUT: that block; a
            # FREE: nothing); a later chunk's record overrides an earlier one's.
            last = last_per_slot(slots, self.capacity)
            is_put = records["op"][last] == _PUT
            self._valid[slots[last[~is_put]]] = False
            self._set_entries(records[last[is_put]], numbers[last[is_put]])
            if len(body) < REPLAY_CHUNK * RECORD_BYTES:   # the end of the journal
                torn = len(body) - whole
                break
        # A block named by two live slots moved: only its newest entry counts.
        live = np.flatnonzero(self._valid)
        seqs, order = self._seq[live], self._order[live]
        by_seq = np.lexsort((order, seqs))
        older = np.zeros(len(by_seq), dtype=bool)
        older[:-1] = seqs[by_seq][:-1] == seqs[by_seq][1:]
        self._valid[live[by_seq[older]]] = False
        self.report = RecoveryReport(len(live) - int(older.sum()), seen, torn, corrupt,
                                     beyond, int(older.sum()))

    def _set_entries(self, chosen: np.ndarray, order: np.ndarray) -> np.ndarray:
        """Make the ``PUT`` records ``chosen`` (record numbers ``order``) their slots' live
        entries; returns those slots."""
        where = chosen["slot"].astype(np.int64)
        self._valid[where] = True
        self._seq[where] = chosen["seq"]
        self._parent[where] = chosen["parent"]
        self._has_parent[where] = (chosen["flags"] & _HAS_PARENT) != 0
        self._local[where] = chosen["local"]
        self._checksum[where] = chosen["checksum"]
        self._tag[where] = chosen["tag"]
        self._seal[where] = chosen["seal"]
        self._order[where] = order
        return where

    # ------------------------------------------------------------------ reading
    def live(self) -> "LiveEntries":
        """The live entries as columns, oldest first (the order their blocks were written)."""
        with self._lock:
            slots = np.flatnonzero(self._valid)
            slots = slots[np.argsort(self._order[slots], kind="stable")]
            return LiveEntries(slots, self._seq[slots].copy(), self._parent[slots].copy(),
                               self._has_parent[slots].copy(), self._local[slots].copy(),
                               self._checksum[slots].copy(), self._tag[slots].copy(),
                               self._seal[slots].copy())

    def entries(self) -> list[IndexEntry]:
        """The live entries, oldest first, one :class:`IndexEntry` each."""
        return self.live().entries()

    def __len__(self) -> int:
        return int(self._valid.sum())

    # ------------------------------------------------------------------ writing
    def free(self, slots: Sequence[int]) -> None:
        """Journal that ``slots`` no longer hold their blocks (before overwriting them).
        Raises :class:`JournalWriteError` naming the slots whose records did not land: they
        still hold their blocks, in the journal and here, and must not be overwritten."""
        with self._lock:
            self._settle_locked(slots)
            slots = [s for s in slots if self._valid[s]]
            if not slots:
                return
            body = b"".join(_record(_FREE, s, 0, None, 0, 0, 0, _NO_SEAL) for s in slots)
            landed, error = self._append(body)
            self._valid[np.asarray(slots[:landed], dtype=np.int64)] = False
            if error is not None:
                raise JournalWriteError(error, slots[landed:]) from error

    def put(self, slots: Sequence[int], sequence_hashes: Sequence[int],
            parent_hashes: Sequence[int | None], local_hashes: Sequence[int],
            checksums: Sequence[int], *, tags: Sequence[int] | None = None,
            seals: Sequence[bytes] | None = None, data_fd: int | None = None) -> None:
        """Journal that ``slots`` now hold these blocks (after their bytes were written),
        with their keyed ``tags`` (None: zeros, an index kept without a key) and the
        ``seals`` of those stored encrypted (None: none). With ``sync``, ``data_fd`` is
        flushed first and the journal after. Raises :class:`JournalWriteError` naming the
        slots whose records did not land (recorded neither here nor in the journal)."""
        if not slots:
            return
        tags = [0] * len(slots) if tags is None else tags
        seals = [_NO_SEAL] * len(slots) if seals is None else seals
        body = b"".join(_record(_PUT, s, h, p, local, c, t, seal)
                        for s, h, p, local, c, t, seal in zip(
                            slots, sequence_hashes, parent_hashes, local_hashes, checksums,
                            tags, seals))
        if self.sync and data_fd is not None:
            try:
                os.fdatasync(data_fd)
            except OSError as exc:
                raise JournalWriteError(exc, slots) from exc
        with self._lock:
            self._settle_locked(slots)
            first = self._records
            landed, error = self._append(body)
            for n, (s, h, p, local, c, t, seal) in enumerate(zip(
                    slots[:landed], sequence_hashes, parent_hashes, local_hashes, checksums,
                    tags, seals)):
                self._valid[s] = True
                self._seq[s] = h
                self._parent[s] = 0 if p is None else p
                self._has_parent[s] = p is not None
                self._local[s] = local
                self._checksum[s] = c
                self._tag[s] = t
                self._seal[s] = np.frombuffer(seal, np.uint8)
                self._order[s] = first + n
            if error is not None:
                raise JournalWriteError(error, slots[landed:]) from error
            if self._records > self._compact_at:
                try:
                    self._rewrite_locked()
                except OSError as exc:     # the blocks are journaled: compact later
                    self._compact_at = 2 * self._records
                    log.warning("kvstrata: compacting %s failed (%s); the journal keeps "
                                "growing until it succeeds", self.path, exc)

    def _settle_locked(self, slots: Sequence[int]) -> None:
        """Before writing to the journal: rewrite it if a failed cut left bytes past its
        last record, or a cut took off whole records (see :meth:`_append`). Raises
        :class:`JournalWriteError` for all ``slots`` while that fails, or once the index
        is closed (a rewrite would open the journal again, its lock let go)."""
        if self._fd < 0:
            raise JournalWriteError(OSError(errno.EBADF, "the disk tier index is closed"),
                                    slots)
        if self._rewrite_due:
            try:
                self._rewrite_locked()
            except OSError as exc:
                raise JournalWriteError(exc, slots) from exc

    def _append(self, body: bytes) -> tuple[int, OSError | None]:
        """Write the whole records ``body`` at the journal's end; returns how many were
        kept and, when not all were, the error that stopped the rest (see the module
        docstring)."""
        view = memoryview(body)
        written = 0
        try:
            while written < len(body):
                done = os.pwrite(self._fd, view[written:], self._end + written)
                if done <= 0:
                    raise OSError(errno.EIO, f"journal write made no progress at "
                                             f"{self._end + written}")
                written += done
            if self.sync:
                os.fdatasync(self._fd)
        except OSError as exc:
            whole = written // RECORD_BYTES * RECORD_BYTES
            # After a failed flush none of the batch is known to be durable: none counts.
            kept = whole if written < len(body) else 0
            try:
                os.ftruncate(self._fd, self._end + kept)
            except OSError as cut:
                self._rewrite_due = True
                log.warning("kvstrata: cutting %s back to its last whole record failed "
                            "(%s); it is rewritten before anything more is journaled",
                            self.path, cut)
            # A follower may have read the whole records cut off; it reads a new file from
            # its start, but would skip new records written where they were in this one.
            self._rewrite_due |= kept < whole
            self._end += kept
            self._records += kept // RECORD_BYTES
            return kept // RECORD_BYTES, exc
        self._end += len(body)
        self._records += len(body) // RECORD_BYTES
        return len(body) // RECORD_BYTES, None

    def _rewrite(self) -> None:
        with self._lock:
            self._rewrite_locked()

    def _rewrite_locked(self) -> None:
        """Replace the journal with one PUT per live entry (temp file, flush, rename)."""
        slots = np.flatnonzero(self._valid)
        slots = slots[np.argsort(self._order[slots], kind="stable")]
        records = np.zeros(len(slots), dtype=_RECORD_DTYPE)
        records["op"] = _PUT
        records["flags"] = np.where(self._has_parent[slots], _HAS_PARENT, 0)
        records["slot"] = slots
        records["seq"] = self._seq[slots]
        records["parent"] = self._parent[slots]
        records["local"] = self._local[slots]
        records["checksum"] = self._checksum[slots]
        records["tag"] = self._tag[slots]
        records["seal"] = self._seal[slots]
        raw = records.tobytes()
        digest = xxhash.xxh3_64_intdigest
        records["xxh"] = np.fromiter((digest(raw[i:i + RECORD_BYTES - 8])
                                      for i in range(0, len(raw), RECORD_BYTES)),
                                     dtype=np.uint64, count=len(records))
        data = _header(self.fingerprint, self.stride, self.key_id) + records.tobytes()
        temp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(temp, self.path)
        _fsync_dir(self.path.parent)
        old, self._fd = self._fd, os.open(self.path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        if old >= 0:
            os.close(old)
        self._end = len(data)
        self._rewrite_due = False
        self._order[slots] = np.arange(len(slots))
        self._records = len(slots)
        self._compact_at = _COMPACT_FACTOR * max(self.capacity, 256)

    def close(self) -> None:
        """Close the journal file (its entries stay for the next open). Idempotent."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def last_per_slot(slots: np.ndarray, capacity: int) -> np.ndarray:
    """Positions, ascending, of the last of ``slots`` naming each slot below ``capacity``:
    in a run of journal records, the ones that decide what their slots hold."""
    inside = np.flatnonzero(slots < capacity)
    backwards = inside[::-1]
    _, first = np.unique(slots[backwards], return_index=True)
    return np.sort(backwards[first])


def _sound(body: bytes, records: np.ndarray) -> np.ndarray:
    """Which of ``records`` (decoded from ``body``, whole records) are sound: their own
    xxh3 matches, their op is known, and a block does not name itself as its parent (no
    block we wrote can)."""
    digest = xxhash.xxh3_64_intdigest
    good = np.fromiter((digest(body[i:i + RECORD_BYTES - 8])
                        for i in range(0, len(records) * RECORD_BYTES, RECORD_BYTES)),
                       dtype=np.uint64, count=len(records)) == records["xxh"]
    good &= (records["op"] == _PUT) | (records["op"] == _FREE)
    good &= ~((records["op"] == _PUT) & ((records["flags"] & _HAS_PARENT) != 0)
              & (records["parent"] == records["seq"]))
    return good


def _record(op: int, slot: int, sequence_hash: int, parent_hash: int | None,
            local_hash: int, checksum: int, tag: int, seal: bytes) -> bytes:
    body = _BODY.pack(op, _HAS_PARENT if parent_hash is not None else 0, 0, slot,
                      sequence_hash, parent_hash or 0, local_hash, checksum, tag, seal)
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")


def _header(fingerprint: str, stride: int, key_id: int) -> bytes:
    raw = _HEADER.pack(_MAGIC, INDEX_VERSION, fingerprint.encode("ascii")[:16], stride, key_id,
                       0)
    return raw[:-8] + xxhash.xxh3_64_intdigest(raw[:-8]).to_bytes(8, "little")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
