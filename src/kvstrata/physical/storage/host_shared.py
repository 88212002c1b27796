"""G2 host RAM that one process writes and others read in place: the ranks of a
tensor-parallel group serving an MLA model hold the same blocks, so they keep one G2.

**Where it lives.** One file in a shared-memory directory (``/dev/shm``: its pages are the
RAM itself), named ``kvstrata-<tier>-<name>``, where the caller makes ``name`` unique among
this host's live servers and puts an owner tag in it
(:func:`~kvstrata.physical.leftovers.owner_tag`): a server killed by SIGKILL leaves a file
that the next writer in that directory removes. The file is a header page (magic, version,
slot count, slot stride, payload bytes), the seal table (three ``uint64`` per slot, rounded
up to whole pages), then the slots. The writer makes it under a temporary name with O_EXCL
and mode 0600, sizes it with ``posix_fallocate`` (on tmpfs the RAM is taken then, or
``ENOSPC`` then), writes the header and links it under its name, so a reader never sees a
file half made; the writer's close removes the name (readers keep their mapping until their
own close). A reader opens it read-only and trusts it only if it is a regular file of this
user that no one else can read or write, with the header and size the reader expects.

**Why a reader never serves a wrong block.** The writer's checksum table
(:class:`PublishedChecksumTable`) publishes each slot's seal as it changes: invalidated
before the slot is overwritten; (sequence hash, xxh3-64, check word) once the bytes are in
place and hashed. A seal states "the block of this hash has bytes of this checksum", and
the writer makes it only from the bytes it put in the slot. The check word mixes slot, hash
and checksum, so a seal read while the writer rewrites it (fields of two seals) fails its
check. A reader (:class:`FollowedHostStorage`) takes one snapshot of a batch's seals,
checks the identities against it, then hashes the slots' bytes and compares them with the
snapshot's checksums: bytes replaced after the snapshot hash to another value. So a block is
served only with the bytes its writer sealed, whatever order the two processes see each
other's stores in.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..buffers import PAGE_SIZE, AlignedBuffer, pinned_if_possible
from ..checksum import GOLDEN_GAMMA, ChecksumTable, fmix64
from ..errors import BlockFailure, FailureKind, StorageConfigError
from ...protocol.layout import FullyContiguousLayout, LayoutConfig
from .host import HostStorage

__all__ = ["SharedHost", "SharedHostFile", "PublishedChecksumTable", "PublishedHostStorage",
           "FollowedHostStorage", "shared_host_path", "shared_file_bytes"]

_MAGIC = b"kvstrata-g2-v1\0\0"
# magic, slots, stride, payload bytes, seals at, slots at, layers, outer, page, inner, dtype
_HEADER = struct.Struct("<16sQQQQQQQQQ16s")
_SEAL_WORDS = 3                         # sequence hash, xxh3-64, check word


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


def _header(config: LayoutConfig, stride: int) -> tuple:
    seals_at, slots_at, _ = _placement(config.num_blocks, stride)
    return (_MAGIC, config.num_blocks, stride, config.block_bytes, seals_at, slots_at,
            config.num_layers, config.outer_dim, config.page_size, config.inner_dim,
            str(config.dtype).encode()[:16].ljust(16, b"\0"))


def shared_file_bytes(num_blocks: int, stride: int) -> int:
    """The size of the file of a shared host tier of ``num_blocks`` slots of ``stride``."""
    return _placement(num_blocks, stride)[2]


def _check_words(slots: np.ndarray, seqs: np.ndarray, sums: np.ndarray) -> np.ndarray:
    """The check word of each seal (odd, so a zeroed seal is never valid)."""
    with np.errstate(over="ignore"):
        mixed = fmix64(seqs ^ fmix64(sums ^ ((slots.astype(np.uint64) + np.uint64(1))
                                             * GOLDEN_GAMMA)))
    return mixed | np.uint64(1)


class SharedHostFile:
    """The mapped file of a shared host tier: :attr:`seals` (``uint64 [slots, 3]``) and
    :meth:`buffer` over its slots. Make it with :meth:`create` (the writer) or
    :meth:`open` (a reader); raises :class:`StorageConfigError`."""

    def __init__(self, path: Path, mapping: mmap.mmap, config: LayoutConfig, stride: int,
                 writable: bool, identity: tuple[int, int]) -> None:
        self.path = path
        self.writable = writable
        self._identity = identity
        self._mapping: mmap.mmap | None = mapping
        seals_at, self._slots_at, _ = _placement(config.num_blocks, stride)
        self._slots_bytes = config.num_blocks * stride
        self.seals: np.ndarray | None = np.frombuffer(
            mapping, dtype=np.uint64, count=config.num_blocks * _SEAL_WORDS,
            offset=seals_at).reshape(config.num_blocks, _SEAL_WORDS)

    @classmethod
    def create(cls, path: str | os.PathLike, config: LayoutConfig,
               stride: int) -> "SharedHostFile":
        """Make the file of ``config.num_blocks`` slots of ``stride`` bytes at ``path``
        (none may exist there), every seal invalid."""
        path = Path(path)
        seals_at, slots_at, size = _placement(config.num_blocks, stride)
        part = path.with_name(f"{path.name}.part-{secrets.token_hex(4)}")
        try:
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StorageConfigError(f"cannot create shared host memory {part}: "
                                     f"{exc.strerror}") from exc
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise StorageConfigError(
                        f"cannot reserve {size} bytes of shared host memory in "
                        f"{path.parent}: {exc.strerror}") from exc
                os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            mapping[:_HEADER.size] = _HEADER.pack(*_header(config, stride))
            try:
                os.link(part, path)
            except OSError as exc:
                raise StorageConfigError(f"cannot publish shared host memory at {path}: "
                                         f"{exc.strerror}") from exc
            st = os.fstat(fd)
            return cls(path, mapping, config, stride, True, (st.st_dev, st.st_ino))
        finally:
            os.close(fd)
            try:
                os.unlink(part)
            except OSError:
                pass

    @classmethod
    def open(cls, path: str | os.PathLike, config: LayoutConfig,
             stride: int) -> "SharedHostFile":
        """Map, read-only, the file another process of this user made at ``path`` for
        these slots."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise StorageConfigError(f"no shared host memory at {path}: "
                                     f"{exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() \
                    or st.st_mode & 0o077:
                raise StorageConfigError(f"shared host memory {path} is not a file of this "
                                         f"user's alone (uid {st.st_uid}, mode "
                                         f"{stat.S_IMODE(st.st_mode):o}): not trusted")
            seals_at, slots_at, size = _placement(config.num_blocks, stride)
            if st.st_size != size:
                raise StorageConfigError(f"shared host memory {path} has {st.st_size} bytes, "
                                         f"{size} expected")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        header = _HEADER.unpack(mapping[:_HEADER.size])
        expected = _header(config, stride)
        if header != expected:
            mapping.close()
            raise StorageConfigError(f"shared host memory {path} holds other slots "
                                     f"({header[1:]}; {expected[1:]} expected)")
        return cls(path, mapping, config, stride, False, (st.st_dev, st.st_ino))

    def buffer(self, pin: bool) -> AlignedBuffer:
        """The slots as an :class:`AlignedBuffer` (registered with CUDA if ``pin`` and the
        driver accepts it, read-only for a reader)."""
        mapped = dict(mapping=self._mapping, offset=self._slots_at,
                      read_only=not self.writable)
        if pin:
            return pinned_if_possible(self._slots_bytes, **mapped)
        return AlignedBuffer(self._slots_bytes, **mapped)

    def snapshot(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One read of the seals of ``slots``: per slot whether its seal is whole and
        valid, its sequence hash and its checksum."""
        rows = self.seals[slots].copy()
        ok = rows[:, 2] == _check_words(slots, rows[:, 0], rows[:, 1])
        return ok, rows[:, 0], rows[:, 1]

    def remove(self) -> None:
        """Remove the file's name if it is still this file's (the writer's close)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path)
        except OSError:
            pass

    def release(self) -> None:
        """Drop this object's views (the mapping goes with the last view of it)."""
        self.seals = None
        self._mapping = None


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
        self._seals[idx[~ok], 2] = 0
        good = idx[ok]
        if good.size:
            seqs, sums = seqs[ok], sums[ok]
            self._seals[good, 0] = seqs
            self._seals[good, 1] = sums
            self._seals[good, 2] = _check_words(good, seqs, sums)

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
    Nothing is ever written: :meth:`begin_write` and :meth:`seal` refuse."""

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

    def _refuse(self, what: str) -> StorageConfigError:
        return StorageConfigError(f"{what}: this host tier is read here, written by the "
                                  f"process that made {self.file.path}")

    def begin_write(self, block_ids: Sequence[int]) -> None:
        raise self._refuse("begin_write")

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
        unless ``verify`` is False (a caller that verifies them as it copies)."""
        self._check_open()
        idx = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        self.check_block_ids(idx)
        ok, seqs, sums = self.file.snapshot(idx)
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
        return failures

    def close(self) -> None:
        if not self.closed:
            super().close()
            self.file.release()
