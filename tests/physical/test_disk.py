"""Disk (G3) storage: slab file, O_DIRECT on/off, fault injection, corruption detection."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import xxhash

from kvstrata.physical import (BlockIntegrityError, ChecksumMismatchError, DiskFullError,
                               DiskStorage, FailureKind, FileOps, StorageConfigError,
                               StorageIOError)
from kvstrata.physical.buffers import AlignedBuffer

from .conftest import FaultyFileOps, random_block_arrays, small_config

O_DIRECT_MODES = [pytest.param(True, id="o_direct"), pytest.param(False, id="buffered")]


def _aligned_blocks(disk, n, seed=0):
    """n block buffers inside one page-aligned buffer, one stride apart."""
    stride = disk.layout.block_stride
    buf = AlignedBuffer(n * stride)
    rng = np.random.default_rng(seed)
    buf.array[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    return buf, [buf.array[i * stride:(i + 1) * stride] for i in range(n)]


@pytest.mark.parametrize("o_direct", O_DIRECT_MODES)
def test_round_trip(tmp_path, o_direct, dtype):
    disk = DiskStorage(small_config(num_blocks=12, dtype=dtype), tmp_path, o_direct=o_direct)
    assert disk.status().o_direct is o_direct
    assert os.path.getsize(disk.path) == 12 * 4096 == disk.status().bytes
    _, blocks = _aligned_blocks(disk, 5)
    slots = [3, 4, 5, 9, 0]                  # a run of three plus singles
    sums = disk.write_blocks(slots, blocks, [11, 12, 13, 14, 15])
    assert len(set(sums)) == 5
    _, out = _aligned_blocks(disk, 5, seed=1)
    disk.read_blocks(slots, out, [11, 12, 13, 14, 15])
    nbytes = disk.config.block_bytes
    for a, b in zip(blocks, out):
        assert np.array_equal(a[:nbytes], b[:nbytes])
    path = disk.path
    disk.close()
    assert not path.exists()


@pytest.mark.parametrize("o_direct", O_DIRECT_MODES)
def test_unaligned_buffers_bounce_through_staging(tmp_path, o_direct):
    disk = DiskStorage(small_config(), tmp_path, o_direct=o_direct)
    nbytes = disk.config.block_bytes
    blocks = [b[1:nbytes + 1] for b in random_block_arrays(3, nbytes + 1)]   # odd addresses
    disk.write_blocks([1, 2, 7], blocks, [1, 2, 3])
    out = [np.zeros(nbytes + 1, dtype=np.uint8)[1:] for _ in range(3)]
    disk.read_blocks([1, 2, 7], out, [1, 2, 3])
    assert all(np.array_equal(a, b) for a, b in zip(blocks, out))


def test_enospc_on_write_reports_failed_blocks(tmp_path):
    ops = FaultyFileOps(write_errno=errno.ENOSPC, fail_offsets={5 * 4096})
    disk = DiskStorage(small_config(), tmp_path, o_direct=False, file_ops=ops)
    _, blocks = _aligned_blocks(disk, 3)
    with pytest.raises(DiskFullError) as info:
        disk.write_blocks([1, 5, 9], blocks, [10, 50, 90])
    err = info.value
    assert err.failed_positions == (1,) and err.failed_block_ids == (5,)
    assert err.failures[0].kind is FailureKind.DISK_FULL
    assert err.checksums[1] is None and None not in (err.checksums[0], err.checksums[2])
    _, out = _aligned_blocks(disk, 2)
    disk.read_blocks([1, 9], out, [10, 90])              # the others are good
    with pytest.raises(BlockIntegrityError, match="not_written"):
        disk.read_blocks([5], out[:1], [50])             # the failed one was never recorded


def test_eio_on_read_reports_failed_blocks(tmp_path):
    ops = FaultyFileOps(read_errno=errno.EIO, fail_offsets={2 * 4096})
    disk = DiskStorage(small_config(), tmp_path, o_direct=True, file_ops=ops)
    _, blocks = _aligned_blocks(disk, 3)
    disk.write_blocks([0, 2, 4], blocks, [1, 2, 3])
    _, out = _aligned_blocks(disk, 3, seed=3)
    with pytest.raises(StorageIOError) as info:
        disk.read_blocks([0, 2, 4], out, [1, 2, 3])
    assert info.value.failed_block_ids == (2,)
    assert info.value.failures[0].kind is FailureKind.IO_ERROR


def test_eio_on_write_is_storage_io_error(tmp_path):
    disk = DiskStorage(small_config(), tmp_path, file_ops=FaultyFileOps(write_errno=errno.EIO,
                                                                      fail_offsets={0}),
                       o_direct=False)
    _, blocks = _aligned_blocks(disk, 2)
    with pytest.raises(StorageIOError) as info:
        disk.write_blocks([0, 1], blocks, [1, 2])     # one run, retried per block
    assert info.value.failed_positions == (0,)
    assert info.value.checksums[1] is not None


def test_flipped_byte_in_slab_is_detected(tmp_path):
    disk = DiskStorage(small_config(), tmp_path, o_direct=True)
    _, blocks = _aligned_blocks(disk, 3)
    disk.write_blocks([0, 1, 2], blocks, [7, 8, 9])
    with open(disk.path, "r+b") as f:      # flip one byte of block 1 behind the storage's back
        f.seek(1 * 4096 + 17)
        byte = f.read(1)
        f.seek(1 * 4096 + 17)
        f.write(bytes([byte[0] ^ 0x40]))
    _, out = _aligned_blocks(disk, 3, seed=5)
    with pytest.raises(ChecksumMismatchError) as info:
        disk.read_blocks([0, 1, 2], out, [7, 8, 9])
    assert info.value.failed_block_ids == (1,)


def test_wrong_sequence_hash_is_refused(tmp_path):
    disk = DiskStorage(small_config(), tmp_path)
    _, blocks = _aligned_blocks(disk, 1)
    disk.write_blocks([3], blocks, [42])
    with pytest.raises(BlockIntegrityError, match="hash_mismatch"):
        disk.read_blocks([3], blocks, [43])


def test_short_writes_are_completed(tmp_path):
    disk = DiskStorage(small_config(), tmp_path, o_direct=False,
                       file_ops=FaultyFileOps(short_writes=True))
    _, blocks = _aligned_blocks(disk, 4)
    disk.write_blocks([0, 1, 2, 3], blocks, [1, 2, 3, 4])
    _, out = _aligned_blocks(disk, 4, seed=9)
    disk.read_blocks([0, 1, 2, 3], out, [1, 2, 3, 4])


class _StalledAfterShortWrite(FaultyFileOps):
    """A write of several blocks lands its first, then every later write lands nothing."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def pwritev(self, fd, buffers, offset):
        self.calls += 1
        if self.calls > 1:
            return 0
        return super().pwritev(fd, buffers[:1], offset)


def test_a_write_that_stalls_after_a_short_one_fails_rather_than_spinning(tmp_path):
    ops = _StalledAfterShortWrite()
    disk = DiskStorage(small_config(), tmp_path, o_direct=False, file_ops=ops)
    _, blocks = _aligned_blocks(disk, 3)
    with pytest.raises(StorageIOError) as info:
        disk.write_blocks([0, 1, 2], blocks, [1, 2, 3])
    assert set(info.value.failed_positions) >= {1, 2}
    assert ops.calls < 10
    _, out = _aligned_blocks(disk, 3, seed=9)
    with pytest.raises(BlockIntegrityError):        # what did not land is never read as held
        disk.read_blocks([1], out[1:2], [2])


class _NoFallocateNoProgress(FaultyFileOps):
    def __init__(self):
        super().__init__(fallocate_errno=errno.EOPNOTSUPP)
        self.calls = 0

    def pwritev(self, fd, buffers, offset):
        self.calls += 1
        return 0


def test_zeros_that_make_no_progress_fail_the_slab_rather_than_spinning(tmp_path):
    ops = _NoFallocateNoProgress()
    with pytest.raises(StorageIOError, match="no progress"):
        DiskStorage(small_config(), tmp_path, file_ops=ops)
    assert ops.calls == 1
    assert list(tmp_path.iterdir()) == []          # no half-made slab left behind


def test_enospc_at_creation(tmp_path):
    with pytest.raises(DiskFullError, match="no space"):
        DiskStorage(small_config(), tmp_path, file_ops=FaultyFileOps(fallocate_errno=errno.ENOSPC))
    assert list(tmp_path.iterdir()) == []          # no half-made slab left behind


def test_fallocate_unsupported_falls_back_to_zeros(tmp_path):
    disk = DiskStorage(small_config(), tmp_path,
                       file_ops=FaultyFileOps(fallocate_errno=errno.EOPNOTSUPP))
    assert os.path.getsize(disk.path) == disk.size
    assert os.stat(disk.path).st_blocks * 512 >= disk.size      # really reserved, not sparse
    assert any("fallocate" in n for n in disk.status().notes)


class _NoDirect(FaultyFileOps):
    def open(self, path, flags, mode=0o600):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return super().open(path, flags, mode)


def test_o_direct_refused_falls_back_with_reason(tmp_path):
    disk = DiskStorage(small_config(), tmp_path, file_ops=_NoDirect())
    status = disk.status()
    assert not status.o_direct and any("O_DIRECT" in n for n in status.notes)
    with pytest.raises(StorageConfigError, match="O_DIRECT"):
        DiskStorage(small_config(), tmp_path, file_ops=_NoDirect(), o_direct=True)


def test_bad_batches_rejected(tmp_path):
    disk = DiskStorage(small_config(num_blocks=4), tmp_path)
    _, blocks = _aligned_blocks(disk, 1)
    with pytest.raises(IndexError):
        disk.write_blocks([4], blocks, [1])
    with pytest.raises(ValueError, match="lengths"):
        disk.write_blocks([0], blocks, [1, 2])
    with pytest.raises(ValueError, match="uint8"):
        disk.write_blocks([0], [np.zeros(8, dtype=np.uint8)], [1])


def test_given_checksums_are_recorded_without_rehashing(tmp_path):
    disk = DiskStorage(small_config(), tmp_path, o_direct=True)
    _, blocks = _aligned_blocks(disk, 3)
    nbytes = disk.config.block_bytes
    real = [xxhash.xxh3_64_intdigest(b[:nbytes]) for b in blocks]
    sums = disk.write_blocks([1, 2, 3], blocks, [1, 2, 3], checksums=[real[0], None, 42])
    assert sums == [real[0], real[1], 42]                 # None entries hashed, others kept
    _, out = _aligned_blocks(disk, 3, seed=4)
    disk.read_blocks([1, 2], out[:2], [1, 2])
    with pytest.raises(ChecksumMismatchError):            # recorded value wins on read
        disk.read_blocks([3], out[2:], [3])
    with pytest.raises(ValueError, match="checksums"):
        disk.write_blocks([1], blocks[:1], [1], checksums=[1, 2])


@pytest.mark.parametrize("o_direct", O_DIRECT_MODES)
def test_overlapped_hashing_paths(tmp_path, o_direct):
    """Batches above ``overlap_bytes`` hash and verify on the helper thread."""
    disk = DiskStorage(small_config(num_blocks=12), tmp_path, o_direct=o_direct, overlap_bytes=1)
    _, blocks = _aligned_blocks(disk, 6)
    slots = [0, 1, 2, 7, 9, 10]
    disk.write_blocks(slots, blocks, list(range(6)))
    with open(disk.path, "r+b") as f:                      # corrupt slot 9
        f.seek(9 * 4096 + 5)
        value = f.read(1)[0]
        f.seek(9 * 4096 + 5)
        f.write(bytes([value ^ 1]))
    _, out = _aligned_blocks(disk, 6, seed=2)
    with pytest.raises(ChecksumMismatchError) as info:
        disk.read_blocks(slots, out, list(range(6)))
    assert info.value.failed_block_ids == (9,)
    nbytes = disk.config.block_bytes
    for i in (0, 1, 2, 3, 5):
        assert np.array_equal(blocks[i][:nbytes], out[i][:nbytes])
    disk.close()


class _CloseFails(FileOps):
    """close(2) that closes, then reports EIO (as NFS may, for a flush it could not do)."""

    def close(self, fd):
        super().close(fd)
        raise OSError(errno.EIO, "close failed")


def test_a_failed_close_while_the_slab_is_opened_is_typed_and_leaks_nothing(tmp_path):
    """The slab is opened, then opened again with O_DIRECT and the first descriptor closed:
    if that close fails, the start fails with a typed error, and neither the O_DIRECT
    descriptor nor the slab file is left."""
    probe = DiskStorage(small_config(), tmp_path, o_direct=None)
    direct = probe.o_direct
    probe.close()
    if not direct:
        pytest.skip("this filesystem refuses O_DIRECT: the slab is never opened twice")
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(StorageConfigError, match="cannot close the slab"):
        DiskStorage(small_config(), tmp_path, o_direct=True, file_ops=_CloseFails())
    assert set(os.listdir("/proc/self/fd")) <= before
    assert os.listdir(tmp_path) == []
