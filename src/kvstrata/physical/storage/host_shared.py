"""G2 host RAM that one process writes and others read in place: the ranks of a
tensor-parallel group serving an MLA model hold the same blocks, so they keep one G2.

**Where it lives.** In an anonymous shared-memory file of the writer (``memfd_create``):
memory that goes back to the system when the writer and the last reader are gone, however
they end (SIGKILL and the OOM killer included), that no filesystem's size limits (Docker's
64 MiB ``/dev/shm``), and that has no name in any directory. It holds a header page
(magic, slot count, stride, payload bytes, block geometry, dtype, nonce), the seal table
(five ``uint64`` per slot, rounded up to whole pages), then the slots; its size is sealed
(``F_SEAL_GROW | F_SEAL_SHRINK``), so no one can cut it under a reader's mapping. Readers
find it through a small *rendezvous file* named ``kvstrata-<tier>-<name>`` in a directory
(``/dev/shm`` by default), where the caller makes ``name`` unique among this host's live
servers with an owner tag (:func:`~kvstrata.physical.leftovers.owner_tag`): it says which
process holds the memory and under which descriptor, and a reader opens that descriptor
through ``/proc/<pid>/fd`` (which the kernel allows to processes that may inspect the
writer: the same user, in its pid namespace or an ancestor's, the writer dumpable). The
rendezvous file is made under a temporary name with O_EXCL and mode 0600 and linked under
its name whole; the writer's close removes it, and one left by a killed writer (a few dozen bytes) is removed by the next
writer in that directory. A reader trusts a rendezvous file only if it is a regular file of
this user that no one else can read or write, and the memory only if it is a memfd of this
user's sealed against resizing, of the size and header the reader expects, with the random
nonce the rendezvous file names (a pid reused after a writer died names other memory).

**Why a reader never serves a wrong block.** The writer's checksum table
(:class:`PublishedChecksumTable`) publishes each slot's seal as it changes: invalidated
before the slot is overwritten; (sequence hash, xxh3-64, device checksum, generation, check
word) once the bytes are in place and hashed. A seal states "the block of this hash has bytes
of this checksum", and the writer makes it only from the bytes it put in the slot. The device
checksum (:func:`~kvstrata.physical.checksum.device_checksum`) is there where the GPU copy
kernel computed one on the writer's offload, flagged in the generation word's low bit. The
check word mixes slot, hash, checksums and generation, so a seal read while the writer
rewrites it (fields of two seals) fails its check. A reader (:class:`FollowedHostStorage`) takes one snapshot of a batch's seals,
checks the identities against it, then hashes the slots' bytes and compares them with the
snapshot's checksums: bytes replaced after the snapshot hash to another value, whatever
order the two processes see each other's stores in. The copy out of the slot comes after
the hash, so once it has landed the transfer engine asks :meth:`FollowedHostStorage.
confirm_read`: a slot whose seal is no longer the one its bytes were verified against (its
generation changes with every change; the writer invalidates a seal before it touches the
bytes, and this relies on that store being seen first, as x86-64 guarantees) is reported
failed, and the engine recomputes that block. (The vLLM connector's scheduler also holds a
G2 slot being loaded until every rank reported its load, so this is a second line.)

**On a GPU, no host pass.** Where a seal carries a device checksum and the reader's copy
engine can sum, the transfer engine asks :meth:`FollowedHostStorage.device_sums_for_read`
for the snapshot's device checksums (the reader remembers that snapshot, as a host check
does), the GPU copy kernel computes the device checksum of the bytes that arrive in G1 and
compares, and :meth:`~FollowedHostStorage.confirm_read` follows as above: the same
guarantee as the writer's own verified loads, without hashing the slots on the host.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..buffers import PAGE_SIZE, AlignedBuffer, pinned_if_possible
from ..checksum import GOLDEN_GAMMA, ChecksumTable, fmix64
from ..errors import BlockFailure, FailureKind, StorageConfigError
from ...paths import write_atomically
from ...protocol.layout import FullyContiguousLayout, LayoutConfig
from .host import HostStorage

__all__ = ["SharedHost", "SharedHostFile", "PublishedChecksumTable", "PublishedHostStorage",
           "FollowedHostStorage", "shared_host_path", "memory_sharing_problem"]

_MAGIC = b"kvstrata-g2-v2\0\0"
# magic, slots, stride, payload bytes, seals at, slots at, layers, outer, page, inner, dtype,
# then the writer's nonce (also in its rendezvous file: this memory, not another like it)
_HEADER = struct.Struct("<16sQQQQQQQQQ16s16s")
_SIZE_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
# sequence hash, xxh3-64, device checksum, generation << 1 | has device checksum, check word
_SEAL_WORDS = 5


def shared_host_path(directory: str | os.PathLike, tier: str, name: str) -> Path:
    """The file of the shared ``tier`` named ``name`` in ``directory``."""
    return Path(directory) / f"kvstrata-{tier.lower()}-{name}"


@dataclass(frozen=True)
class SharedHost:
    """A host tier kept once for processes that hold the same blocks: in which directory,
    under which name (unique among this host's live servers, with an owner tag), and
    whether this process writes it (else it reads the writer's)."""

    directory: str
    name: str
    writer: bool

    def path(self, tier: str) -> Path:
        """The file of ``tier`` (:func:`shared_host_path`)."""
        return shared_host_path(self.directory, tier, self.name)


def _placement(num_blocks: int, stride: int) -> tuple[int, int, int]:
    """Offsets of the seal table and of the slots, and the file's size."""
    seals_at = PAGE_SIZE
    slots_at = seals_at + -(-num_blocks * _SEAL_WORDS * 8 // PAGE_SIZE) * PAGE_SIZE
    return seals_at, slots_at, slots_at + num_blocks * stride


def _header(config: LayoutConfig, stride: int, nonce: bytes) -> tuple:
    seals_at, slots_at, _ = _placement(config.num_blocks, stride)
    return (_MAGIC, config.num_blocks, stride, config.block_bytes, seals_at, slots_at,
            config.num_layers, config.outer_dim, config.page_size, config.inner_dim,
            str(config.dtype).encode()[:16].ljust(16, b"\0"), nonce)


def memory_sharing_problem() -> str | None:
    """Why processes of this user cannot share host memory here the way
    :class:`SharedHostFile` does (None if they can): a memfd opened again through
    ``/proc/<pid>/fd``, which needs a mounted ``/proc`` and a writer the kernel lets its
    peers inspect (dumpable)."""
    try:
        fd = os.memfd_create("kvstrata-probe", os.MFD_CLOEXEC)
    except (AttributeError, OSError) as exc:
        return f"cannot make shared memory (memfd_create): {exc}"
    try:
        try:
            os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            return f"shared memory cannot be opened through /proc here: {exc.strerror}"
    finally:
        os.close(fd)
    try:
        import ctypes

        dumpable = ctypes.CDLL(None, use_errno=True).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
    except (OSError, AttributeError):
        return None
    if dumpable != 1:
        return ("this process is not dumpable (PR_SET_DUMPABLE): its peers cannot open its "
                "shared memory")
    return None


def _check_words(slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The check word of each seal (its first four words in ``rows``; odd, so a zeroed seal
    is never valid)."""
    with np.errstate(over="ignore"):
        mixed = fmix64(rows[:, 0] ^ fmix64(rows[:, 1] ^ fmix64(rows[:, 2] ^ fmix64(
            rows[:, 3] ^ ((slots.astype(np.uint64) + np.uint64(1)) * GOLDEN_GAMMA)))))
    return mixed | np.uint64(1)


@dataclass(frozen=True)
class Seals:
    """One read of some slots' seals: ``ok`` per slot (whole and valid), and their words."""

    ok: np.ndarray
    rows: np.ndarray

    @property
    def sequence_hashes(self) -> np.ndarray:
        return self.rows[:, 0]

    @property
    def checksums(self) -> np.ndarray:
        """xxh3-64 of each slot's bytes."""
        return self.rows[:, 1]

    @property
    def device_sums(self) -> np.ndarray:
        """Each slot's device checksum (meaningful where :attr:`device_known`)."""
        return self.rows[:, 2]

    @property
    def device_known(self) -> np.ndarray:
        return (self.rows[:, 3] & np.uint64(1)).astype(bool)

    def keys(self) -> list[tuple[int, int, int]]:
        """What identifies each seal for :meth:`FollowedHostStorage.confirm_read`: hash,
        xxh3 and the generation word (bumped by every change)."""
        return [(row[0], row[1], row[3]) for row in self.rows.tolist()]


class SharedHostFile:
    """The mapped shared memory of a shared host tier: :attr:`seals` (``uint64 [slots,
    5]``) and :meth:`buffer` over its slots. Made with :meth:`create` (the writer, which
    also publishes the rendezvous file at ``path``) or :meth:`open` (a reader, which finds
    the writer's memory through it); both raise :class:`StorageConfigError`."""

    def __init__(self, path: Path, mapping: mmap.mmap, config: LayoutConfig, stride: int,
                 writable: bool, memory_fd: int | None = None,
                 rendezvous: tuple[int, int] | None = None) -> None:
        self.path = path
        self.writable = writable
        self._memory_fd = memory_fd          # the writer keeps it open for readers to find
        self._rendezvous = rendezvous        # (device, inode) of the file the writer made
        self._mapping: mmap.mmap | None = mapping
        seals_at, self._slots_at, _ = _placement(config.num_blocks, stride)
        self._slots_bytes = config.num_blocks * stride
        self.seals: np.ndarray | None = np.frombuffer(
            mapping, dtype=np.uint64, count=config.num_blocks * _SEAL_WORDS,
            offset=seals_at).reshape(config.num_blocks, _SEAL_WORDS)

    @classmethod
    def create(cls, path: str | os.PathLike, config: LayoutConfig,
               stride: int) -> "SharedHostFile":
        """Make the memory of ``config.num_blocks`` slots of ``stride`` bytes, every seal
        invalid, and publish its rendezvous file at ``path`` (none may exist there)."""
        path = Path(path)
        size = _placement(config.num_blocks, stride)[2]
        try:
            fd = os.memfd_create(f"kvstrata-{path.name}",
                                 os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError) as exc:
            raise StorageConfigError(f"cannot make shared host memory (memfd_create): "
                                     f"{exc}") from exc
        mapping = None
        try:
            try:
                os.posix_fallocate(fd, 0, size)   # the RAM is taken now, or refused now
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                            fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
                mapping = mmap.mmap(fd, size, mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                raise StorageConfigError(f"cannot reserve {size} bytes of shared host "
                                         f"memory: {exc.strerror}") from exc
            nonce = secrets.token_bytes(16)
            mapping[:_HEADER.size] = _HEADER.pack(*_header(config, stride, nonce))
            rendezvous = _publish(path, _RENDEZVOUS.pack(_RENDEZVOUS_MAGIC, os.getpid(), fd,
                                                         size, nonce))
        except BaseException:
            # the mapping holds the memory (and a descriptor of its own) until closed: a
            # traceback kept by the caller would otherwise keep it all
            if mapping is not None:
                mapping.close()
            os.close(fd)
            raise
        return cls(path, mapping, config, stride, True, memory_fd=fd, rendezvous=rendezvous)

    @classmethod
    def open(cls, path: str | os.PathLike, config: LayoutConfig,
             stride: int) -> "SharedHostFile":
        """Map, read-only, the memory that the rendezvous file at ``path`` names, made by
        another process of this user for these slots."""
        path = Path(path)
        pid, number, size, nonce = _read_rendezvous(path)
        expected_size = _placement(config.num_blocks, stride)[2]
        if size != expected_size:
            raise StorageConfigError(f"shared host memory of {path} has {size} bytes, "
                                     f"{expected_size} expected")
        try:
            fd = os.open(f"/proc/{pid}/fd/{number}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise StorageConfigError(
                f"cannot open the shared host memory that process {pid} holds for {path}: "
                f"{exc.strerror} (share_host_tier false keeps a host tier per process)") from exc
        try:
            st = os.fstat(fd)
            try:
                sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SIZE_SEALS == _SIZE_SEALS
            except OSError:
                sealed = False                   # not a memfd
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() \
                    or st.st_size != size or not sealed:
                raise StorageConfigError(f"the memory {path} names is not this user's shared "
                                         f"host memory of {size} bytes: not trusted")
            try:
                mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            except OSError as exc:
                raise StorageConfigError(f"cannot map the shared host memory of {path}: "
                                         f"{exc.strerror}") from exc
        finally:
            os.close(fd)
        header = _HEADER.unpack(mapping[:_HEADER.size])
        expected = _header(config, stride, nonce)
        if header != expected:
            mapping.close()
            what = ("is another writer's (its nonce differs)" if header[:-1] == expected[:-1]
                    else f"holds other slots ({header[1:-1]}; {expected[1:-1]} expected)")
            raise StorageConfigError(f"shared host memory of {path} {what}")
        return cls(path, mapping, config, stride, False)

    def buffer(self, pin: bool) -> AlignedBuffer:
        """The slots as an :class:`AlignedBuffer` (registered with CUDA if ``pin`` and the
        driver accepts it, read-only for a reader)."""
        mapped = dict(mapping=self._mapping, offset=self._slots_at,
                      read_only=not self.writable)
        if pin:
            return pinned_if_possible(self._slots_bytes, **mapped)
        return AlignedBuffer(self._slots_bytes, **mapped)

    def snapshot(self, slots: np.ndarray) -> "Seals":
        """One read of the seals of ``slots``."""
        rows = self.seals[slots].copy()
        return Seals(rows[:, 4] == _check_words(slots, rows), rows)

    def remove(self) -> None:
        """Remove the rendezvous file if it is still the one this writer made."""
        if self._rendezvous is None:
            return
        try:
            st = os.stat(self.path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == self._rendezvous:
                os.unlink(self.path)
        except OSError:
            pass

    def release(self) -> None:
        """Drop this object's views (the mapping goes with the last view of it) and the
        writer's descriptor (the memory goes with the last process mapping it)."""
        self.seals = None
        self._mapping = None
        if self._memory_fd is not None:
            os.close(self._memory_fd)
            self._memory_fd = None


_RENDEZVOUS_MAGIC = b"kvstrata-g2-rdv1"
_RENDEZVOUS = struct.Struct("<16sQQQ16s")  # magic, writer's pid, its descriptor, bytes, nonce


def _publish(path: Path, content: bytes) -> tuple[int, int]:
    """Write ``content`` to a new file at ``path`` (mode 0600, whole or not at all; none
    may exist there); returns its (device, inode)."""
    try:
        return write_atomically(path, content, exclusive=True, mode=0o600)
    except OSError as exc:
        raise StorageConfigError(f"cannot publish shared host memory at {path}: "
                                 f"{exc.strerror}") from exc


def _read_rendezvous(path: Path) -> tuple[int, int, int, bytes]:
    """(pid, descriptor, bytes, nonce) from the rendezvous file at ``path``, trusted only as
    a regular file of this user's alone holding exactly one record."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise StorageConfigError(f"no shared host memory at {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 \
                or st.st_size != _RENDEZVOUS.size:
            raise StorageConfigError(f"{path} is not a file of this user's alone naming "
                                     f"shared host memory (uid {st.st_uid}, mode "
                                     f"{stat.S_IMODE(st.st_mode):o}, {st.st_size} bytes): "
                                     f"not trusted")
        data = os.pread(fd, _RENDEZVOUS.size, 0)
    finally:
        os.close(fd)
    magic, pid, number, size, nonce = _RENDEZVOUS.unpack(data) \
        if len(data) == _RENDEZVOUS.size else (b"", 0, 0, 0, b"")
    if magic != _RENDEZVOUS_MAGIC or not 0 < pid < 2**31 or number >= 2**31:
        raise StorageConfigError(f"{path} does not name shared host memory: not trusted")
    return pid, number, size, nonce


class PublishedChecksumTable(ChecksumTable):
    """A :class:`ChecksumTable` whose every change is published in a
    :class:`SharedHostFile`'s seal table (see the module docstring)."""

    def __init__(self, num_blocks: int, file: SharedHostFile) -> None:
        super().__init__(num_blocks)
        self._seals = file.seals

    def _changed(self, idx: np.ndarray) -> None:
        if self._seals is None or not idx.size:
            return
        ok, seqs, sums = self.sealed(idx)
        device, device_known = self.device_sums_of(idx)
        # every change: a new generation (the word's low bit flags a device checksum)
        generations = (self._seals[idx, 3] >> np.uint64(1)) + np.uint64(1)
        bad = idx[~ok]
        self._seals[bad, 4] = 0                               # invalid first, then the rest
        self._seals[bad, 3] = generations[~ok] << np.uint64(1)
        good = idx[ok]
        if good.size:
            known = device_known[ok]
            rows = np.stack([seqs[ok], sums[ok], np.where(known, device[ok], np.uint64(0)),
                             (generations[ok] << np.uint64(1)) | known.astype(np.uint64)],
                            axis=1)
            self._seals[good, :4] = rows
            self._seals[good, 4] = _check_words(good, rows)

    def detach(self) -> None:
        """Stop publishing (the file is going)."""
        self._seals = None


class PublishedHostStorage(HostStorage):
    """The writer's side of a shared G2: a :class:`HostStorage` whose slots and seals are
    in a :class:`SharedHostFile`. Every block is hashed when it is sealed, even where the
    checksum would otherwise be deferred, so that readers can verify it at once."""

    def __init__(self, config: LayoutConfig, path: str | os.PathLike, *,
                 pin: bool | None = None, verify_reads: bool = False,
                 hash_threads: int | None = None) -> None:
        stride = FullyContiguousLayout(config).block_stride
        self.file = SharedHostFile.create(path, config, stride)
        want_pin = torch.cuda.is_available() if pin is None else bool(pin)
        try:
            super().__init__(config, pin=pin, verify_reads=verify_reads, checksums="eager",
                             hash_threads=hash_threads, buffer=self.file.buffer(want_pin),
                             table=PublishedChecksumTable(config.num_blocks, self.file))
        except BaseException:
            self.file.remove()
            self.file.release()
            raise

    def seal(self, block_ids: Sequence[int], sequence_hashes: Sequence[int],
             checksums: Sequence[int | None] | None = None, *,
             defer: bool = False, device_sums: np.ndarray | None = None) -> list[int | None]:
        values = super().seal(block_ids, sequence_hashes, checksums, defer=defer,
                              device_sums=device_sums)
        if any(v is None for v in values):
            # hashed now (after the device checksum check, where the GPU copy made one):
            # published to the readers by the table; a block that fails stays invalid
            self._xxh3_of(block_ids)
        return values

    def close(self) -> None:
        if not self.closed:
            self.checksums.detach()
            self.file.remove()
            super().close()
            self.file.release()


class FollowedHostStorage(HostStorage):
    """A reader's side of a shared G2: the writer's slots mapped read-only, every read
    verified against one snapshot of the writer's seals (see the module docstring).
    Nothing is ever written: :meth:`begin_write` and :meth:`seal` refuse; nothing is stored
    from it (:attr:`written_elsewhere`)."""

    written_elsewhere = True

    def __init__(self, config: LayoutConfig, path: str | os.PathLike, *,
                 pin: bool | None = None, hash_threads: int | None = None) -> None:
        stride = FullyContiguousLayout(config).block_stride
        self.file = SharedHostFile.open(path, config, stride)
        want_pin = torch.cuda.is_available() if pin is None else bool(pin)
        try:
            # its own table stays empty: anything that consults it instead of the seals
            # finds no block
            super().__init__(config, pin=pin, verify_reads=True, checksums="eager",
                             hash_threads=hash_threads, buffer=self.file.buffer(want_pin))
        except BaseException:
            self.file.release()
            raise
        self._array.flags.writeable = False   # a stray write raises here, not SIGSEGV
        self._verified = threading.local()    # per copying thread: slot -> [seal, checks]

    def _refuse(self, what: str) -> StorageConfigError:
        return StorageConfigError(f"{what}: this host tier is read here, written by the "
                                  f"process that made {self.file.path}")

    def begin_write(self, block_ids: Sequence[int]) -> None:
        raise self._refuse("begin_write")

    def forget(self, block_ids: Sequence[int]) -> None:
        """Nothing to do here: the writer forgets its slots, and its seals say so."""

    def block_view(self, block_id: int) -> torch.Tensor:
        """A copy of slot ``block_id`` as a typed tensor (a view would be a writable tensor
        over memory mapped read-only)."""
        return super().block_view(block_id).clone()

    def seal(self, block_ids, sequence_hashes, checksums=None, *, defer=False,
             device_sums=None):
        raise self._refuse("seal")

    def pin_held(self, sequence_hashes: Sequence[int]) -> list[tuple[int, int, int]]:
        raise self._refuse("pin_held")

    def ensure_checksums(self, block_ids: Sequence[int]) -> list[int]:
        raise self._refuse("ensure_checksums")

    def check_readable(self, block_ids: Sequence[int], sequence_hashes: Sequence[int],
                       *, verify: bool | None = None) -> list[BlockFailure]:
        """Failures of the slots that must not be read as ``sequence_hashes``, checked
        against one snapshot of the writer's seals; the bytes are hashed and compared
        unless ``verify`` is False (a caller that verifies them as it copies, through
        :meth:`device_sums_for_read`)."""
        self._check_open()
        idx = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        self.check_block_ids(idx)
        seals = self.file.snapshot(idx)
        ok, seqs, sums = seals.ok, seals.sequence_hashes, seals.checksums
        wanted = np.asarray(sequence_hashes, dtype=np.uint64).reshape(-1)
        failures = [BlockFailure(int(p), int(idx[p]), FailureKind.NOT_WRITTEN,
                                 "slot holds no sealed block")
                    for p in np.flatnonzero(~ok)]
        failures += [BlockFailure(int(p), int(idx[p]), FailureKind.HASH_MISMATCH,
                                  f"slot holds sequence hash {int(seqs[p])}, not "
                                  f"{int(wanted[p])}")
                     for p in np.flatnonzero(ok & (seqs != wanted))]
        if verify is not False:
            at = np.flatnonzero(ok & (seqs == wanted))
            if at.size:
                actual = self.payload_checksums(idx[at])
                failures += [BlockFailure(int(at[i]), int(idx[at[i]]),
                                          FailureKind.CHECKSUM_MISMATCH,
                                          f"xxh3-64 {int(actual[i]):#018x} != sealed "
                                          f"{int(sums[at[i]]):#018x}")
                             for i in np.flatnonzero(actual != sums[at])]
        failures.sort(key=lambda f: f.position)
        if verify is not False:          # what confirm_read compares with after the copy
            bad = {f.position for f in failures}
            self._remember(idx, seals, [p for p in range(len(idx)) if p not in bad])
        return failures

    def device_sums_for_read(self, block_ids: Sequence[int],
                             sequence_hashes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(sums, known)`` from one snapshot of the writer's seals: the device checksums
        a copy of these slots into G1 must produce, ``known`` where a slot holds the block
        of ``sequence_hashes`` under a whole seal that carries one. Slots ``known`` are
        remembered, like those :meth:`check_readable` verifies: the caller calls
        :meth:`confirm_read` on them once the copy has landed (or did not happen)."""
        self._check_open()
        idx = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        self.check_block_ids(idx)
        seals = self.file.snapshot(idx)
        wanted = np.asarray(sequence_hashes, dtype=np.uint64).reshape(-1)
        known = seals.ok & seals.device_known & (seals.sequence_hashes == wanted)
        self._remember(idx, seals, np.flatnonzero(known).tolist())
        return np.where(known, seals.device_sums, np.uint64(0)), known

    def _remember(self, idx: np.ndarray, seals: "Seals", positions: list[int]) -> None:
        """Keep, per copying thread, the seal each slot at ``positions`` was checked
        against, for :meth:`confirm_read`: the earliest of a slot checked more than once
        before its copies are confirmed (a change since any of those checks fails them
        all)."""
        verified = self._verified.__dict__.setdefault("seals", {})
        keys, slots = seals.keys(), idx.tolist()
        for p in positions:
            slot = slots[p]
            held = verified.get(slot)
            verified[slot] = [keys[p], 1] if held is None else [held[0], held[1] + 1]

    def forget_reads(self) -> None:
        self._verified.__dict__.pop("seals", None)

    def confirm_read(self, block_ids: Sequence[int],
                     sequence_hashes: Sequence[int]) -> list[BlockFailure]:
        """After the copy out of slots this thread's :meth:`check_readable` verified (or
        :meth:`device_sums_for_read` gave device checksums of) has landed: failures of
        those whose seal is no longer the one their bytes were verified against. The
        writer invalidates a seal before it touches a slot's bytes, so a slot rewritten
        while it was copied out fails here, and a block copied whole is never passed on as
        another's."""
        verified = self._verified.__dict__.setdefault("seals", {})
        idx = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        seals = self.file.snapshot(idx)
        keys, ok = seals.keys(), seals.ok.tolist()
        failures = []
        for p, slot in enumerate(idx.tolist()):
            held = verified.get(slot)
            if held is not None:
                held[1] -= 1
                if held[1] <= 0:
                    del verified[slot]
            # the generation changes with every change of the seal: a slot rewritten and
            # then given back its block (same hash and checksum) fails too
            if held is None or not ok[p] or held[0] != keys[p] \
                    or held[0][0] != int(sequence_hashes[p]):
                failures.append(BlockFailure(p, slot, FailureKind.NOT_WRITTEN,
                                             "slot rewritten while it was read"))
        return failures

    def close(self) -> None:
        if not self.closed:
            super().close()
            self.file.release()
