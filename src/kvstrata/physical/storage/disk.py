"""G3 disk storage: one preallocated slab file per pool, a FullyContiguous block per slot.

(Over 400 lines on purpose: one concern, a slab file's I/O -- O_DIRECT probing, run
coalescing, bounce buffers and verified reads belong together.)

``DiskStorage(config, directory)`` creates ``kvstrata-<name>-<pid>-<random>.slab`` in
``directory`` and reserves ``num_blocks * block_stride`` bytes with ``os.posix_fallocate``
(falling back to ``ftruncate`` plus writing zeros where the filesystem cannot fallocate).
``block_stride`` is the payload rounded up to 4096, so every block starts on a 4 KiB boundary.

O_DIRECT is probed by opening the slab with ``O_DIRECT`` and writing one aligned page; if the
filesystem refuses, buffered I/O is used and ``status().notes`` records why (``o_direct=True``
makes the refusal an error instead). I/O is positional (``os.pwritev``/``os.preadv``), runs of
consecutive slots are coalesced into one call, and buffers that are not 4 KiB-aligned (or
shorter than a stride) are bounced through page-aligned ``mmap`` staging buffers.

Integrity: :meth:`DiskStorage.write_blocks` hashes each block (xxh3-64) and records the hash
and sequence hash only after the write succeeded; :meth:`DiskStorage.read_blocks` always checks
the slot holds the requested sequence hash and re-hashes the bytes read. With a
:class:`~kvstrata.physical.tags.BlockTagger` (``tagger``, the deployment's secret) every block
written is also tagged, and every block read must match its tag too: bytes someone else put
in the slab (and the index) do not pass without the key. Failures raise a
:class:`~kvstrata.physical.errors.BlockIOError` subclass — :class:`DiskFullError` (ENOSPC),
:class:`StorageIOError` (EIO, short I/O), :class:`BlockIntegrityError` /
:class:`ChecksumMismatchError` — whose ``failures`` name the failed positions and slots; all
other blocks of the batch completed.

The file is deleted on :meth:`close` unless ``keep_file=True``. Nothing here holds a lock
across I/O, but for a followed slab (below), whose reads hold one so that no journal refresh
changes what a block is checked against while it is read; concurrent calls on distinct slots
are safe.

**Durable** (:meth:`DiskStorage.durable`): the slab is ``slab`` in a home directory named by
the blocks' compatibility fingerprint and locked for this process (:mod:`.disk_home`), with
an index journal beside it (:mod:`.disk_index`): a write frees the slots in the index, writes
the bytes, then records the blocks. A restart recovers the recorded blocks (:attr:`recovered`)
into the checksum table, so every recovered block is verified when first read; the slab is
resized (never rewritten) to the configured size.

**Followed** (:meth:`DiskStorage.follow`): another process's durable slab, opened read-only
where that process keeps it, for blocks that are the same on several ranks and stored once
(:mod:`.disk_follow`). :meth:`DiskStorage.refresh` takes in what the writer journaled since,
and every read is verified against that, so a block the writer overwrote meanwhile fails its
check; nothing is ever written, journaled or locked.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..buffers import AlignedBuffer, address_of
from ..checksum import ChecksumTable, block_checksum
from ..leftovers import owner_tag, reclaim
from ..errors import (BlockFailure, DiskFullError, FailureKind, StorageConfigError,
                      StorageIOError, raise_for_failures)
from ...paths import make_directories
from ...protocol.layout import FullyContiguousLayout, LayoutConfig
from ...protocol.layout_codec import StorageDescriptor
from .base import BlockStore, StorageStatus
from .disk_follow import FollowedJournal
from .disk_home import DiskTierHome, check_fingerprint, home_name, private_file
from .disk_index import DiskIndex, JournalWriteError, LiveEntries
from .fileio import FileOps
from ..tags import NO_SEAL, SEAL_BYTES, BlockCipher, BlockTagger

__all__ = ["DiskStorage", "Durability", "DIRECT_ALIGNMENT", "slab_stride"]

log = logging.getLogger(__name__)

DIRECT_ALIGNMENT = 4096
_IOV_MAX = 1024
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


@dataclass(frozen=True)
class Durability:
    """What makes a :class:`DiskStorage` durable: its claimed home, the fingerprint of its
    blocks, and whether every write is flushed (``sync``)."""

    home: DiskTierHome
    fingerprint: str
    sync: bool = False


def slab_stride(config: LayoutConfig) -> int:
    """Bytes between two blocks of a slab of ``config``'s geometry (4 KiB-aligned)."""
    return FullyContiguousLayout(
        config.with_alignment(max(config.alignment, DIRECT_ALIGNMENT))).block_stride


def _failure_kind(exc: OSError) -> FailureKind:
    return FailureKind.DISK_FULL if exc.errno in _FULL_ERRNOS else FailureKind.IO_ERROR


class DiskStorage(BlockStore):
    """Slab-file block pool (G3). See the module docstring for the I/O and integrity rules."""

    kind = "disk"

    def __init__(self, config: LayoutConfig, directory: str | os.PathLike, *,
                 name: str = "g3", o_direct: bool | None = None,
                 file_ops: FileOps | None = None, max_io_bytes: int = 16 << 20,
                 staging_buffers: int = 2, keep_file: bool = False,
                 overlap_bytes: int = 256 << 10, durable: "Durability | None" = None,
                 tagger: BlockTagger | None = None, cipher: BlockCipher | None = None,
                 encrypt: bool = False, followed: str | None = None) -> None:
        layout = FullyContiguousLayout(
            config.with_alignment(max(config.alignment, DIRECT_ALIGNMENT)))
        super().__init__(layout)
        self._ops = file_ops or FileOps()
        self._stride = layout.block_stride
        self._max_run = max(1, min(max_io_bytes // self._stride, _IOV_MAX))
        self._keep_file = keep_file or durable is not None or followed is not None
        self._followed = followed
        """The fingerprint of the durable tier in ``directory`` another process writes,
        which this one reads (:meth:`follow`); None: this process writes its slab."""
        self._journal: FollowedJournal | None = None
        self._refresh_lock = threading.Lock()
        self.notes: list[str] = []
        self.checksums = ChecksumTable(config.num_blocks)
        self._staging: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
        self._staging_left = max(1, staging_buffers)
        self._staging_lock = threading.Lock()
        self._hash_pool: ThreadPoolExecutor | None = None
        self._overlap_bytes = overlap_bytes
        self._durable = durable
        self._tagger = tagger
        fingerprint = durable.fingerprint if durable is not None else followed
        self._tag_identity = (fingerprint or "").encode()
        self._tags = np.zeros(config.num_blocks, dtype=np.uint64) if tagger else None
        """The keyed tag of the block in each slot (with a tagger)."""
        if encrypt and (cipher is None or tagger is None):
            raise StorageConfigError("encrypting a disk tier needs the deployment's secret")
        self._cipher = cipher
        self._encrypt = encrypt
        self._seals = np.zeros((config.num_blocks, SEAL_BYTES), np.uint8) if tagger else None
        """The seal of the block in each slot stored encrypted (zeros: stored in clear)."""
        self.index: DiskIndex | None = None
        self.recovered: LiveEntries | None = None
        """Durable only: the entries recovered from the index at start, oldest first."""

        directory = Path(directory)
        try:
            if followed is None:
                make_directories(directory)
        except OSError as exc:
            raise StorageConfigError(f"cannot create disk pool directory {directory}: {exc}") from exc
        self.size = layout.region_bytes(0)
        if followed is not None:
            self.path = directory / "slab"
            flags = os.O_RDONLY | os.O_CLOEXEC
        elif durable is None:
            reclaim(directory, f"kvstrata-{name}-")       # slabs of killed processes
            self.path = directory / f"kvstrata-{name}-{owner_tag()}-{secrets.token_hex(4)}.slab"
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        else:
            self.path = directory / "slab"
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            fd = self._ops.open(str(self.path), flags | os.O_NOFOLLOW)
        except OSError as exc:
            raise StorageConfigError(f"cannot open the slab {self.path}: "
                                     f"{exc.strerror or exc}") from exc
        try:
            if durable is not None or followed is not None:
                private_file(fd, self.path, tighten=followed is None)
            if followed is None:
                self._preallocate(fd)
            self._fd, self.o_direct = self._open_for_io(fd, o_direct)
        except BaseException:
            self._ops.close(fd)
            if durable is None and followed is None:
                self._remove_file()
            raise
        try:
            if self._fd != fd:
                try:
                    self._ops.close(fd)
                except OSError as exc:
                    raise StorageConfigError(f"cannot close the slab {self.path}: "
                                             f"{exc.strerror or exc}") from exc
            if durable is not None:
                self._recover(durable)
            elif followed is not None:
                self._journal = FollowedJournal(directory / "index", capacity=self.num_blocks,
                                                fingerprint=followed, stride=self._stride,
                                                key_id=self.key_id)
                self.refresh()
                self.recovered = self._journal.live()
        except BaseException:
            with contextlib.suppress(OSError):     # the first error is the one to tell
                self._ops.close(self._fd)
            if self.index is not None:
                self.index.close()
            if self._journal is not None:
                self._journal.close()
            if durable is None and followed is None:
                self._remove_file()
            raise

    @classmethod
    def durable(cls, config: LayoutConfig, directory: str | os.PathLike, *, fingerprint: str,
                rank: int = 0, describe: str = "", sync: bool = False, name: str = "g3",
                **options) -> "DiskStorage":
        """A disk tier that survives restarts: its slab and index live in a home under
        ``directory`` named by ``rank`` and ``fingerprint`` (:mod:`.disk_home`, locked for
        this process); the blocks a previous process stored there are recovered
        (:attr:`recovered`) and verified when first read. ``sync`` flushes data and index
        at every write (survives power loss, costs a flush per batch)."""
        check_fingerprint(fingerprint)
        home = DiskTierHome.claim(directory, tier=name, rank=rank, fingerprint=fingerprint,
                                  describe=describe)
        try:
            tier = cls(config, home.path, name=name,
                       durable=Durability(home, fingerprint, sync), **options)
        except BaseException:
            home.abandon()
            raise
        home.remove_stale()          # only once this tier stands: a failed start loses nothing
        return tier

    @classmethod
    def follow(cls, config: LayoutConfig, directory: str | os.PathLike, *, fingerprint: str,
               rank: int = 0, name: str = "g3", **options) -> "DiskStorage":
        """The durable disk tier another process keeps under ``directory`` (the
        :meth:`durable` one of the same ``fingerprint``, ``rank`` and ``name``), read in
        place and never written (:mod:`.disk_follow`): :meth:`refresh` learns what it holds
        now, and every block read is verified against that. Raises ``StorageConfigError``
        when there is no such tier (yet), or its files are not this user's alone."""
        check_fingerprint(fingerprint)
        return cls(config, Path(directory) / home_name(name, rank, fingerprint), name=name,
                   followed=fingerprint, **options)

    @property
    def followed(self) -> bool:
        """Whether another process writes this slab (:meth:`follow`): read-only here."""
        return self._followed is not None

    def slot_of(self, sequence_hash: int) -> int | None:
        """A followed tier: the slot its writer keeps block ``sequence_hash`` in, as of the
        last :meth:`refresh` (None: not held, or this tier is not followed)."""
        return None if self._journal is None else self._journal.slot_of(sequence_hash)

    def refresh(self) -> bool:
        """A followed tier (:meth:`follow`): take in what its writer journaled since the
        last call. False when the writer's slab was replaced since this one opened it
        (another home was made in its place): reopen to follow the new one."""
        if self._journal is None:
            return True
        with self._refresh_lock:
            self._take_in_journal()
        try:
            now = os.stat(self.path)
        except OSError:
            return False
        opened = os.fstat(self._fd)
        return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)

    def _take_in_journal(self) -> None:
        """Apply the followed journal's changes to the checks reads make (refresh lock held)."""
        changed = self._journal.refresh()
        if len(changed):
            self.checksums.invalidate(changed.tolist())
            live = self._journal.entries_at(changed)
            if len(live):
                self.checksums.record_many(live.slots, live.checksums, live.sequence_hashes)
                if self._tags is not None:
                    self._tags[live.slots] = live.tags
                    self._seals[live.slots] = live.seals

    def _recover(self, durable: "Durability") -> None:
        index = DiskIndex.open(self.path.parent / "index", capacity=self.num_blocks,
                               fingerprint=durable.fingerprint, stride=self._stride,
                               sync=durable.sync, key_id=self.key_id)
        self.index = index
        live = index.live()
        if self._encrypt and len(live) and not live.seals.any(axis=1).all():
            # Encryption turned on: blocks kept in clear are not served (their slots are
            # overwritten as the tier refills; remove the directory to erase them now).
            clear = live.slots[~live.seals.any(axis=1)]
            try:
                index.free(clear.tolist())
            except JournalWriteError as exc:
                raise StorageConfigError(f"cannot write the disk tier index {index.path}: "
                                         f"{exc.strerror or exc}") from exc
            self.notes.append(f"dropped {len(clear)} blocks kept in clear (encrypt_at_rest "
                              f"is on)")
            live = index.live()
        if len(live):
            if self._tags is not None:
                self._tags[live.slots] = live.tags
                self._seals[live.slots] = live.seals
            self.checksums.record_many(live.slots, live.checksums, live.sequence_hashes)
        self.recovered = live
        report = index.report
        dropped = [f"{n} {what}" for n, what in (
            (report.corrupt_records, "damaged index records"),
            (report.beyond_capacity, "entries past the slab's end"),
            (report.duplicates, "stale duplicates")) if n]
        if report.torn_bytes:
            dropped.append(f"a torn {report.torn_bytes}-byte record")
        self.notes.append(f"recovered {len(live)} blocks"
                          + (f" ({report.fresh_reason})" if report.fresh_reason else "")
                          + (f"; dropped {', '.join(dropped)}" if dropped else ""))

    # ------------------------------------------------------------------ set-up
    def _preallocate(self, fd: int) -> None:
        existing = os.fstat(fd).st_size if self._durable is not None else 0
        if existing > self.size:          # a durable slab configured smaller: cut it down
            self._ops.ftruncate(fd, self.size)
            return
        try:
            self._ops.fallocate(fd, 0, self.size)
            return
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                raise DiskFullError(f"no space for a {self.size}-byte slab in "
                                    f"{self.path.parent}: {exc}", ()) from exc
            if exc.errno not in _NO_FALLOCATE:
                raise StorageIOError(f"posix_fallocate of {self.path} failed: {exc}", ()) from exc
            self.notes.append(f"posix_fallocate unsupported ({exc.strerror}); wrote zeros")
        self._ops.ftruncate(fd, self.size)
        zeros = AlignedBuffer(min(self.size, 8 << 20))
        offset = existing                 # never overwrite a durable slab's blocks
        try:
            while offset < self.size:
                view = zeros.array[:min(zeros.size, self.size - offset)]
                wrote = self._ops.pwritev(fd, [view], offset)
                if wrote <= 0:
                    raise OSError(errno.EIO, "write made no progress")
                offset += wrote
        except OSError as exc:
            cls = DiskFullError if exc.errno in _FULL_ERRNOS else StorageIOError
            raise cls(f"reserving {self.size} bytes for {self.path} failed at offset "
                      f"{offset}: {exc}", ()) from exc

    def _open_for_io(self, fd: int, o_direct: bool | None) -> tuple[int, bool]:
        if o_direct is False:
            self.notes.append("O_DIRECT disabled by configuration")
            return fd, False
        if not hasattr(os, "O_DIRECT"):
            reason = "this platform has no O_DIRECT"
        else:
            direct_fd = None
            mode = os.O_RDONLY if self.followed else os.O_RDWR
            try:
                direct_fd = self._ops.open(str(self.path),
                                          mode | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW)
                probe = AlignedBuffer(DIRECT_ALIGNMENT)
                # Rewrite the first page with what it holds (a durable slab keeps its blocks;
                # a followed one is only read, and its writer may not have sized it yet: then
                # the open with O_DIRECT is the probe).
                sized = not self.followed or os.fstat(direct_fd).st_size >= DIRECT_ALIGNMENT
                if (self._durable is not None or self.followed) and sized and \
                        self._ops.preadv(direct_fd, [probe.array], 0) != DIRECT_ALIGNMENT:
                    raise OSError(errno.EIO, "short probe read")
                if not self.followed and \
                        self._ops.pwritev(direct_fd, [probe.array], 0) != DIRECT_ALIGNMENT:
                    raise OSError(errno.EIO, "short probe write")
                return direct_fd, True
            except OSError as exc:
                if direct_fd is not None:
                    self._ops.close(direct_fd)
                reason = f"filesystem refused O_DIRECT ({exc.strerror or exc})"
        if o_direct:
            raise StorageConfigError(f"O_DIRECT requested for {self.path} but {reason}")
        self.notes.append(f"buffered I/O: {reason}")
        return fd, False

    # ------------------------------------------------------------------ data path
    def write_blocks(self, block_ids: Sequence[int], sources: Sequence[np.ndarray],
                     sequence_hashes: Sequence[int], *,
                     checksums: Sequence[int] | None = None,
                     parent_hashes: Sequence[int | None] | None = None,
                     local_hashes: Sequence[int] | None = None) -> list[int]:
        """Write ``sources[i]`` (``uint8`` arrays of at least ``block_bytes``) to slot
        ``block_ids[i]``. Returns the xxh3-64 recorded for each block; raises a
        :class:`BlockIOError` subclass naming failed positions (``.checksums`` then has
        ``None`` for those).

        ``checksums``, when given, are the blocks' known xxh3-64 (e.g. recorded when they
        entered G2) and are recorded as they are, without hashing the sources again: a source
        whose bytes no longer match is then caught when the block is read back. Sources
        without one (``checksums`` omitted, or ``None`` entries) are hashed on a helper
        thread while the writes run.

        A durable storage journals the written blocks in its index after their bytes landed
        when ``parent_hashes`` and ``local_hashes`` give their identity (without it they are
        served until the process ends, but not recovered). A block whose journal record
        could not be written (a full disk) fails too, :class:`DiskFullError` for a full
        one, and is not served; a slot the journal could not release keeps its block and
        is not written."""
        if self.followed:
            raise StorageConfigError(f"{self.path} is followed read-only: another process "
                                     f"writes it")
        self._check_batch(block_ids, sources, sequence_hashes)
        if checksums is not None and len(checksums) != len(block_ids):
            raise ValueError(f"{len(checksums)} checksums for {len(block_ids)} blocks")
        self.checksums.invalidate(block_ids)
        failures: list[BlockFailure] = []
        failed: set[int] = set()
        if self.index is not None:
            try:
                self.index.free(block_ids)            # before their bytes change
            except JournalWriteError as exc:      # those slots keep their blocks: not written
                _fail_unjournaled(exc, "releasing the slot", block_ids, failures, failed)
        block_bytes = self.config.block_bytes
        known = [None] * len(block_ids) if checksums is None else list(checksums)
        # Blocks without a known checksum are hashed and, with a tagger, every block is
        # tagged over its recorded checksum too (a journal record whose checksum was swapped
        # fails): one pass, on the helper thread while the writes run when the batch is big.
        views = [src[:block_bytes] for src in sources]
        job = None
        if self._tagger is not None or None in known:
            work = (list(sequence_hashes), known, views)
            if len(views) * block_bytes >= self._overlap_bytes:
                job = self._helper().submit(self._hash_and_tag, *work)
            else:
                job = self._hash_and_tag(*work)
        seals: list[bytes] = [NO_SEAL] * len(block_ids)

        def write(run: list[int]) -> None:
            sealed = self._write_run(block_ids[run[0]], [sources[p] for p in run],
                                     [sequence_hashes[p] for p in run])
            for p, seal in zip(run, sealed):
                seals[p] = seal

        todo = [p for p in range(len(block_ids)) if p not in failed] if failed \
            else range(len(block_ids))
        try:
            for run in self._runs([block_ids[p] for p in todo]):
                for positions, exc in self._isolating([todo[i] for i in run], write):
                    failures.extend(BlockFailure(p, block_ids[p], _failure_kind(exc),
                                                 f"write failed: {exc}") for p in positions)
                    failed.update(positions)
        finally:
            if job is not None and not isinstance(job, tuple):
                job = job.result()
        tagging = None
        if job is not None:
            known, tagging = job
        sums: list[int | None] = known
        good = [p for p in range(len(block_ids)) if p not in failed] if failed \
            else range(len(block_ids))
        if self.index is not None and local_hashes is not None and parent_hashes is not None:
            try:
                self.index.put([block_ids[p] for p in good], [sequence_hashes[p] for p in good],
                               [parent_hashes[p] for p in good], [local_hashes[p] for p in good],
                               [sums[p] for p in good], data_fd=self._fd,
                               tags=None if tagging is None else [tagging[p] for p in good],
                               seals=[seals[p] for p in good])
            except JournalWriteError as exc:      # not recorded: not served either
                _fail_unjournaled(exc, "recording the block", block_ids, failures, failed)
                good = [p for p in good if p not in failed]
        for p in failed:
            sums[p] = None
        if tagging is not None:       # before the checksums make the slots readable
            self._tags[[block_ids[p] for p in good]] = [tagging[p] for p in good]
            self._seals[[block_ids[p] for p in good]] = np.frombuffer(
                b"".join(seals[p] for p in good), np.uint8).reshape(-1, SEAL_BYTES)
        if failed:
            self.checksums.record_many([block_ids[p] for p in good], [sums[p] for p in good],
                                       [sequence_hashes[p] for p in good])
        else:
            self.checksums.record_many(block_ids, sums, sequence_hashes)
        raise_for_failures(f"write to {self.path.name}", failures, len(block_ids), sums)
        return sums  # type: ignore[return-value]

    def forget(self, block_ids: Sequence[int]) -> None:
        """Slots ``block_ids`` no longer hold their blocks, for good: a durable slab journals
        it, so a restart does not recover them (an invalidation, as opposed to an eviction,
        whose bytes stay valid until the slot is written again). Raises
        :class:`~.disk_index.JournalWriteError` (an ``OSError``) naming the slots the journal
        could not take (a full disk): they are no longer served here, but a restart before
        their slots are written again recovers them."""
        self.checksums.invalidate(block_ids)
        if self.index is not None:
            self.index.free(block_ids)

    def read_blocks(self, block_ids: Sequence[int], destinations: Sequence[np.ndarray],
                    sequence_hashes: Sequence[int]) -> list[int]:
        """Read slot ``block_ids[i]`` into ``destinations[i]`` (``uint8`` arrays of at least
        ``block_bytes``), verifying sequence hash and checksum (the checksum of one run of
        slots is verified on a helper thread while the next run is read); returns the
        verified checksums. Raises a :class:`BlockIOError` subclass naming failed positions
        (its ``checksums`` hold the good blocks'); a failed destination may hold garbage and
        must not be used. A followed tier first takes in what its writer journaled until now,
        and no refresh changes what a block is checked against while it is read."""
        self._check_batch(block_ids, destinations, sequence_hashes)
        if self._journal is None:
            return self._read_verified(block_ids, destinations, sequence_hashes)
        with self._refresh_lock:
            self._take_in_journal()
            return self._read_verified(block_ids, destinations, sequence_hashes)

    def _read_verified(self, block_ids: Sequence[int], destinations: Sequence[np.ndarray],
                       sequence_hashes: Sequence[int]) -> list[int]:
        failures = self.checksums.check_identities(block_ids, sequence_hashes)
        if failures:
            refused = {f.position for f in failures}
            wanted = [p for p in range(len(block_ids)) if p not in refused]
        else:
            wanted = list(range(len(block_ids)))
        pending: list = []
        try:
            for run in self._runs([block_ids[p] for p in wanted]):
                for positions, exc in self._isolating(
                        [wanted[i] for i in run],
                        lambda r: self._read_run(block_ids[r[0]], [destinations[p] for p in r],
                                                 r, block_ids, sequence_hashes, failures,
                                                 pending)):
                    failures.extend(BlockFailure(p, block_ids[p], FailureKind.IO_ERROR,
                                                 f"read failed: {exc}") for p in positions)
        finally:
            for item in pending:
                failures.extend(item.result() if hasattr(item, "result") else item)
        rotten = [f.block_id for f in failures if f.kind is FailureKind.CHECKSUM_MISMATCH]
        if rotten:
            # Bytes that fail their checksum are gone for good: forget them in the index too,
            # or every restart would recover and announce them again (a followed tier's
            # writer keeps its journal: they are forgotten here until it writes them again).
            self.checksums.invalidate(rotten)
            if self.index is not None:
                # if the journal cannot take it, a restart finds them rotten again
                with contextlib.suppress(JournalWriteError):
                    self.index.free(rotten)
            elif self._journal is not None:
                self._journal.forget_here(rotten)
        sums = self.checksums.checksums_of(block_ids)
        if failures:
            for f in failures:
                sums[f.position] = None
        raise_for_failures(f"read from {self.path.name}", failures, len(block_ids), sums)
        return sums  # type: ignore[return-value]

    # ------------------------------------------------------------------ helpers
    def _check_batch(self, block_ids, buffers, sequence_hashes) -> None:
        self._check_open()
        if not len(block_ids) == len(buffers) == len(sequence_hashes):
            raise ValueError(f"batch lengths differ: {len(block_ids)} ids, {len(buffers)} "
                             f"buffers, {len(sequence_hashes)} sequence hashes")
        self.check_block_ids(block_ids)
        for buf in buffers:
            if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size < self.config.block_bytes:
                raise ValueError(f"block buffers must be 1-D uint8 arrays of at least "
                                 f"{self.config.block_bytes} bytes")

    def _runs(self, block_ids: Sequence[int]) -> list[list[int]]:
        """Positions grouped into runs of consecutive slots (each run one syscall)."""
        order = sorted(range(len(block_ids)), key=lambda p: block_ids[p])
        runs: list[list[int]] = []
        for p in order:
            if runs and block_ids[p] == block_ids[runs[-1][-1]] + 1 \
                    and len(runs[-1]) < self._max_run:
                runs[-1].append(p)
            else:
                runs.append([p])
        return runs

    @staticmethod
    def _isolating(run: list[int], io) -> list[tuple[list[int], OSError]]:
        """Do ``io(run)``; if it fails, retry block by block so one bad block does not fail
        its neighbours. Returns ``(positions, error)`` for what still failed."""
        try:
            io(run)
            return []
        except OSError as exc:
            if len(run) == 1:
                return [(run, exc)]
        failed = []
        for p in run:
            try:
                io([p])
            except OSError as exc:
                failed.append(([p], exc))
        return failed

    def _direct_ok(self, buf: np.ndarray) -> bool:
        return buf.size >= self._stride and (
            not self.o_direct or address_of(buf) % DIRECT_ALIGNMENT == 0)

    def _write_run(self, first_slot: int, sources: list[np.ndarray],
                   sequence_hashes: list[int]) -> list[bytes]:
        """Write ``sources`` to consecutive slots from ``first_slot``; returns their seals
        (encrypting, through staging; :data:`NO_SEAL` each when stored in clear)."""
        offset = first_slot * self._stride
        seals = [NO_SEAL] * len(sources)
        if not self._encrypt and all(self._direct_ok(s) for s in sources):
            self._pwrite_all([s[:self._stride] for s in sources], offset)
            return seals
        staging = self._acquire_staging(len(sources))
        try:
            block_bytes = self.config.block_bytes
            views = []
            for i, src in enumerate(sources):
                view = staging.array[i * self._stride:(i + 1) * self._stride]
                if self._encrypt:
                    seals[i] = self._cipher.encrypt(self._tag_identity, sequence_hashes[i],
                                                    src[:block_bytes], view[:block_bytes])
                else:
                    view[:block_bytes] = src[:block_bytes]
                views.append(view)
            self._pwrite_all(views, offset)
        finally:
            self._staging.put(staging)
        return seals

    def _read_run(self, first_slot: int, dests: list[np.ndarray], positions: list[int],
                  block_ids: Sequence[int], sequence_hashes: Sequence[int],
                  failures: list[BlockFailure], pending: list) -> None:
        offset = first_slot * self._stride
        block_bytes = self.config.block_bytes
        if all(self._direct_ok(d) for d in dests):
            self._pread_all([d[:self._stride] for d in dests], offset)
            work = (positions, block_ids, sequence_hashes, [d[:block_bytes] for d in dests])
            if len(dests) * block_bytes >= self._overlap_bytes:
                pending.append(self._helper().submit(self._verify, *work))  # overlaps next read
            else:
                pending.append(self._verify(*work))
            return
        staging = self._acquire_staging(len(dests))
        try:
            views = [staging.array[i * self._stride:(i + 1) * self._stride]
                     for i in range(len(dests))]
            self._pread_all(views, offset)
            for pos, dest, view in zip(positions, dests, views):
                failure = self._check(pos, block_ids[pos], sequence_hashes[pos],
                                      view[:block_bytes])
                if failure is None:
                    dest[:block_bytes] = view[:block_bytes]   # only verified bytes go out
                else:
                    failures.append(failure)
        finally:
            self._staging.put(staging)

    @property
    def key_id(self) -> int:
        """The public id of the key blocks are tagged with (0: no key)."""
        return 0 if self._tagger is None else self._tagger.key_id

    def _check(self, position: int, slot: int, sequence_hash: int,
               data: np.ndarray) -> BlockFailure | None:
        """Failure record if ``data`` does not hash to its slot's checksum or, with a
        tagger, does not match its slot's tag."""
        if self._seals is not None and self._seals[slot].any():    # stored encrypted
            if self._cipher is None or not self._cipher.decrypt(
                    self._tag_identity, sequence_hash, data, self._seals[slot].tobytes(), data):
                data[:] = 0              # what failed its GCM tag is not left readable
                return BlockFailure(position, slot, FailureKind.CHECKSUM_MISMATCH,
                                    "encrypted block does not open under this deployment's "
                                    "key" if self._cipher is not None else
                                    "block stored encrypted and encryption is not set up")
            return self.checksums.check_bytes(position, slot, data)
        failure = self.checksums.check_bytes(position, slot, data)
        if failure is not None or self._tagger is None:
            return failure
        entry = self.checksums.get(slot)
        tag = self._tag(sequence_hash, entry[0] if entry is not None else None, data)
        if tag != int(self._tags[slot]):
            return BlockFailure(position, slot, FailureKind.CHECKSUM_MISMATCH,
                                "keyed tag does not match: not written under this "
                                "deployment's key")
        return None

    def _hash_and_tag(self, sequence_hashes: list[int], known: list[int | None],
                      views: list[np.ndarray]) -> tuple[list[int], list[int] | None]:
        """The checksums of ``views`` (``known`` where given) and, with a tagger, their
        tags."""
        sums = [c if c is not None else block_checksum(v) for c, v in zip(known, views)]
        if self._tagger is None:
            return sums, None
        if self._encrypt:                 # GCM authenticates an encrypted block: no tag
            return sums, [0] * len(sums)
        return sums, [self._tag(h, c, v) for h, c, v in zip(sequence_hashes, sums, views)]

    def _tag(self, sequence_hash: int, checksum: int | None, data) -> int:
        """The tag of ``data`` stored as ``sequence_hash`` with ``checksum`` recorded."""
        identity = self._tag_identity + (checksum or 0).to_bytes(8, "little")
        return self._tagger.tag(identity, sequence_hash, data)

    def _verify(self, positions: list[int], block_ids: Sequence[int],
                sequence_hashes: Sequence[int], views: list[np.ndarray]) -> list[BlockFailure]:
        """Failures of the blocks read at ``positions`` into ``views``."""
        out = []
        for pos, view in zip(positions, views):
            failure = self._check(pos, block_ids[pos], sequence_hashes[pos], view)
            if failure is not None:
                out.append(failure)
        return out

    def _helper(self) -> ThreadPoolExecutor:
        """One helper thread that hashes while this thread does I/O (created on first use)."""
        with self._staging_lock:
            if self._hash_pool is None:
                self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-disk-hash")
            return self._hash_pool

    def _pwrite_all(self, buffers: list[np.ndarray], offset: int) -> None:
        total = len(buffers) * self._stride
        done = self._ops.pwritev(self._fd, buffers, offset)
        if done <= 0:
            raise OSError(errno.EIO, f"write made no progress at offset {offset}")
        while done < total:   # short write: continue where it stopped
            rest = _tail(buffers, done, self._stride)
            wrote = self._ops.pwritev(self._fd, rest, offset + done)
            if wrote <= 0:
                raise OSError(errno.EIO, f"write made no progress at offset {offset + done}")
            done += wrote

    def _pread_all(self, buffers: list[np.ndarray], offset: int) -> None:
        total = len(buffers) * self._stride
        done = self._ops.preadv(self._fd, buffers, offset)
        while done < total:
            if done <= 0:
                raise OSError(errno.EIO, f"short read at offset {offset + max(done, 0)}")
            rest = _tail(buffers, done, self._stride)
            got = self._ops.preadv(self._fd, rest, offset + done)
            if got <= 0:
                raise OSError(errno.EIO, f"short read at offset {offset + done} (end of file)")
            done += got

    def _acquire_staging(self, blocks: int) -> AlignedBuffer:
        """A staging buffer for ``blocks`` blocks; waits (without spinning) if all are busy."""
        try:
            return self._staging.get_nowait()
        except queue.Empty:
            pass
        with self._staging_lock:
            create = self._staging_left > 0
            if create:
                self._staging_left -= 1
        if create:
            return AlignedBuffer(self._max_run * self._stride)
        return self._staging.get()

    # ------------------------------------------------------------------ description
    def status(self) -> StorageStatus:
        cfg = self.config
        return StorageStatus(kind=self.kind, blocks=cfg.num_blocks, block_bytes=cfg.block_bytes,
                             bytes=self.size, o_direct=self.o_direct, path=str(self.path),
                             notes=tuple(self.notes))

    def descriptors(self) -> tuple[StorageDescriptor, ...]:
        return (StorageDescriptor("disk", self.size, path=str(self.path)),)

    def close(self) -> None:
        """Close the file and delete it (unless ``keep_file`` or durable: a durable tier
        keeps slab and index for the next start and gives up its lock). Idempotent."""
        if self.closed:
            return
        super().close()
        with self._staging_lock:
            pool, self._hash_pool = self._hash_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        try:
            self._ops.close(self._fd)
        finally:
            if self.index is not None:
                self.index.close()
            if self._journal is not None:
                self._journal.close()
            if self._durable is not None:
                self._durable.home.release()
            if not self._keep_file:
                self._remove_file()

    def _remove_file(self) -> None:
        try:
            self._ops.unlink(str(self.path))
        except FileNotFoundError:
            pass


def _fail_unjournaled(exc: JournalWriteError, step: str, block_ids: Sequence[int],
                      failures: list[BlockFailure], failed: set[int]) -> None:
    """Fail the positions of ``block_ids`` whose journal records ``exc`` says did not land."""
    unrecorded = set(exc.unrecorded)
    kind = _failure_kind(exc)
    for p, slot in enumerate(block_ids):
        if slot in unrecorded and p not in failed:
            failures.append(BlockFailure(p, slot, kind, f"{step} in the index journal "
                                                        f"failed: {exc}"))
            failed.add(p)


def _tail(buffers: list[np.ndarray], done: int, stride: int) -> list[np.ndarray]:
    """The part of equally sized ``buffers`` after the first ``done`` bytes."""
    first, skip = divmod(done, stride)
    rest = list(buffers[first:])
    if skip:
        rest[0] = rest[0][skip:]
    return rest
