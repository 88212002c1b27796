"""Block checksums (xxh3-64 of a block's payload bytes) and the per-slot table that keeps them.

A storage that keeps checksums (host G2, disk G3) owns a :class:`ChecksumTable` with one
entry per slot: valid flag, xxh3-64 of the payload and the sequence hash of the block that was
written there. The integrity rule: a slot is *invalidated before* bytes are written into it and
*recorded only after* the write completed; a read is served only if the slot is valid, holds
the requested sequence hash and (when verifying) the bytes hash to the recorded value.

A valid slot's checksum may be *unknown* (``None``): a host storage with deferred checksums
records a block as soon as its bytes are in place and hashes it on first need (see
:class:`~kvstrata.physical.storage.host.HostStorage`); :meth:`ChecksumTable.fill` records the
hash later.

Entries are plain numpy scalars; distinct slots may be updated from different threads (the
logical layer never schedules two transfers on one slot at a time).
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import xxhash

from .errors import BlockFailure, FailureKind

__all__ = ["block_checksum", "ChecksumTable", "native_range_checksums", "BATCH_VERIFIER",
           "memory_checksums", "device_checksum", "memory_device_checksums", "fmix64",
           "GOLDEN_GAMMA"]


def block_checksum(data) -> int:
    """xxh3-64 (seed 0) of a bytes-like object (bytes, memoryview, contiguous numpy array)."""
    return xxhash.xxh3_64_intdigest(data)


def _load_range_checksums():
    """``kvstrata._tokenhash.checksum_ranges`` bound to the xxhash library's own functions
    and checked against :func:`block_checksum`, or None (not built, a stale build, another
    ABI): callers then hash range by range in Python, with the same results."""
    try:
        from .. import _tokenhash
        from ..tokens import xxhash_function_address
    except ImportError:
        return None
    if not all(hasattr(_tokenhash, n) for n in ("bind", "bind_stream", "checksum_ranges")):
        return None
    probe = np.frombuffer(b"kvstrata checksum probe, in two ranges", dtype=np.uint8)
    base = probe.ctypes.data
    try:
        _tokenhash.bind(xxhash_function_address())
        _tokenhash.bind_stream(*(xxhash_function_address(f"XXH3_{n}") for n in (
            "createState", "64bits_reset", "64bits_update", "64bits_digest", "freeState")))
        addresses = np.array([base, base + 9, base, base + 9], dtype=np.uint64)
        lengths = np.array([9, probe.size - 9, 9, probe.size - 9], dtype=np.uint64)
        whole = _tokenhash.checksum_ranges(addresses[:1], np.array([probe.size], np.uint64), 1)
        split = _tokenhash.checksum_ranges(addresses, lengths, 2)
    except Exception:
        return None
    expected = block_checksum(probe)
    if whole is None or split is None or np.frombuffer(whole, np.uint64).tolist() != [expected] \
            or np.frombuffer(split, np.uint64).tolist() != [expected, expected]:
        return None
    return _tokenhash.checksum_ranges


_range_checksums = _load_range_checksums()


def _load_batch_verifier():
    """``(verify_batches, verify_arrived)`` of ``kvstrata._tokenhash`` (a verified read's
    batches hashed as they arrive by a thread that never takes the GIL; Linux builds), checked
    on a probe, or None: readers then hand batches over in Python, with the same results."""
    if _range_checksums is None:
        return None
    from .. import _tokenhash
    verify, arrived = (getattr(_tokenhash, n, None) for n in ("verify_batches", "verify_arrived"))
    if verify is None or arrived is None:
        return None
    probe = np.frombuffer(b"kvstrata batch probe: two blocks", dtype=np.uint8)
    addresses = np.array([probe.ctypes.data, probe.ctypes.data + 16], dtype=np.uint64)
    lengths = np.array([16, 16], dtype=np.uint64)
    expected = np.array([block_checksum(probe[:16]), 0], dtype=np.uint64)
    state, bad = np.zeros(4, np.uint32), np.zeros(2, np.uint8)
    try:
        arrived(state, 2, False)
        verify(state, addresses, lengths, expected, bad, 1, 1, 2, 0)
    except Exception:
        return None
    return (verify, arrived) if bad.tolist() == [0, 1] and state.tolist() == [
        0x80000002, 2, 2, 0] else None


BATCH_VERIFIER = _load_batch_verifier()


def native_range_checksums(addresses: np.ndarray, lengths: np.ndarray,
                           per_block: int) -> np.ndarray | None:
    """The xxh3-64 checksum of each block of memory, a block being ``per_block`` consecutive
    ranges (``addresses[i]``, ``lengths[i]``: contiguous uint64 arrays) hashed as one
    stream, computed natively with the GIL let go; None where the native path is not built
    (then hash the ranges with :func:`block_checksum`). The caller vouches that every range
    is readable memory of this process: nothing is checked here."""
    if _range_checksums is None:
        return None
    out = _range_checksums(addresses, lengths, per_block)
    return None if out is None else np.frombuffer(out, dtype=np.uint64)


_PHI, _M1, _M2 = (np.uint64(v) for v in (0x9E3779B97F4A7C15, 0xFF51AFD7ED558CCD,
                                          0xC4CEB9FE1A85EC53))
GOLDEN_GAMMA = _PHI
"""2**64 / the golden ratio, odd: multiplying distinct small integers by it spreads them."""
_S33 = np.uint64(33)


def device_checksum(payload) -> int:
    """The *device checksum* of a block's payload (a bytes-like whose length is a multiple of
    8): ``sum(fmix64(w[i] ^ (i + 1) * PHI)) mod 2**64`` over its little-endian 64-bit words
    ``w``, fmix64 being murmur3's 64-bit finalizer. A sum of independent per-word terms, so
    the GPU copy kernel computes it piece by piece in any order while the bytes pass
    (:mod:`._triton_copy`); this is the same function on the host, in numpy, for checks
    and tests. Not a cryptographic hash: it detects corruption, not forgery."""
    words = np.frombuffer(payload, dtype="<u8")
    return int(fmix64(words ^ (np.arange(1, words.size + 1, dtype=np.uint64) * _PHI))
               .sum(dtype=np.uint64))


def fmix64(k: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer of each ``uint64`` of ``k`` (a new array)."""
    k = k ^ (k >> _S33)
    k *= _M1
    k ^= k >> _S33
    k *= _M2
    k ^= k >> _S33
    return k


def _load_device_sums():
    """``kvstrata._tokenhash.device_sums`` checked against :func:`device_checksum` on a
    probe, or None (not built, a stale build, a big-endian host): numpy then."""
    try:
        from .. import _tokenhash
    except ImportError:
        return None
    native = getattr(_tokenhash, "device_sums", None)
    if native is None:
        return None
    probe = np.frombuffer(bytes(range(256)) * 2, dtype=np.uint8)
    try:
        out = native(np.array([probe.ctypes.data, probe.ctypes.data + 256], np.uint64), 256)
    except Exception:
        return None
    if out is None or np.frombuffer(out, np.uint64).tolist() != [
            device_checksum(probe[:256]), device_checksum(probe[256:])]:
        return None
    return native


_native_device_sums = _load_device_sums()


def memory_device_checksums(addresses: Sequence[int] | np.ndarray, length: int, *,
                            threads: int = 1) -> np.ndarray:
    """:func:`device_checksum` of ``length`` bytes at each of ``addresses`` (``uint64``
    array), natively with the GIL let go where built (split over up to ``threads`` threads),
    else in numpy. The caller vouches the ranges are readable memory of this process."""
    def hash_part(chunk: np.ndarray) -> np.ndarray:
        if _native_device_sums is None:
            return _python_per_range(device_checksum, chunk, length)
        return np.frombuffer(_native_device_sums(chunk, length), dtype=np.uint64)
    return _per_range(hash_part, addresses, length, threads, min_part_bytes=length)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_POOL_THREADS = max(8, os.cpu_count() or 1)


def _forget_pool_in_child() -> None:
    # a forked child has the pool's state but none of its threads: start afresh there
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def _hash_pool() -> ThreadPoolExecutor:
    """The process's checksum threads: created on first use, at its full size, and never
    replaced (a caller may be submitting to it from any thread)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="kvstrata-hash")
        return _pool


def _python_per_range(digest, addresses: np.ndarray, length: int) -> np.ndarray:
    """``digest`` of ``length`` bytes at each address, range by range in Python."""
    return np.array([digest((ctypes.c_char * length).from_address(int(a)))
                     for a in addresses.tolist()], dtype=np.uint64)


def _per_range(hash_part, addresses, length: int, threads: int,
               min_part_bytes: int) -> np.ndarray:
    """``hash_part(chunk of addresses) -> uint64 array`` over all ``addresses``, split into
    up to ``threads`` parts of at least ``min_part_bytes`` run on the checksum threads, this
    thread taking the first part (the hashes let the GIL go, so the parts run in parallel)."""
    addrs = np.ascontiguousarray(np.asarray(addresses, dtype=np.uint64).reshape(-1))
    n = addrs.size
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    parts = int(max(1, min(threads, n, (n * length) // max(1, min_part_bytes), _POOL_THREADS)))
    if parts == 1:
        return hash_part(addrs)
    bounds = [n * i // parts for i in range(parts + 1)]
    futures = [_hash_pool().submit(hash_part, addrs[bounds[i]:bounds[i + 1]])
               for i in range(1, parts)]
    first = hash_part(addrs[bounds[0]:bounds[1]])
    return np.concatenate([first] + [f.result() for f in futures])


def memory_checksums(addresses: Sequence[int] | np.ndarray, length: int, *,
                     threads: int = 1, min_part_bytes: int = 4 << 20) -> np.ndarray:
    """The xxh3-64 of ``length`` bytes at each of ``addresses`` (``uint64`` array), split over
    up to ``threads`` threads (each part at least ``min_part_bytes``; the native hash lets
    the GIL go, so the parts run in parallel). The caller vouches that every range is
    readable memory of this process that stays alive and unchanged during the call."""
    def hash_part(chunk: np.ndarray) -> np.ndarray:
        out = native_range_checksums(chunk, np.full(chunk.size, length, dtype=np.uint64), 1)
        return out if out is not None else _python_per_range(block_checksum, chunk, length)
    return _per_range(hash_part, addresses, length, threads, min_part_bytes)


class ChecksumTable:
    """Per-slot (valid, checksum, sequence hash) records for ``num_blocks`` slots.

    Every change to records ends with :meth:`_changed` on their slots, which a table
    published to other processes overrides
    (:class:`~kvstrata.physical.storage.host_shared.PublishedChecksumTable`)."""

    def __init__(self, num_blocks: int) -> None:
        self._valid = np.zeros(num_blocks, dtype=bool)
        self._checksum = np.zeros(num_blocks, dtype=np.uint64)
        self._seq = np.zeros(num_blocks, dtype=np.uint64)
        self._known = np.zeros(num_blocks, dtype=bool)   # checksum computed
        # the device checksum (see device_checksum) where the GPU copy kernel computed one
        self._device = np.zeros(num_blocks, dtype=np.uint64)
        self._device_known = np.zeros(num_blocks, dtype=bool)

    def __len__(self) -> int:
        return len(self._valid)

    def valid_mask(self) -> np.ndarray:
        """A copy of the per-slot valid flags."""
        return self._valid.copy()

    def sequence_hashes_of(self, slots: np.ndarray) -> np.ndarray:
        """The sequence hashes recorded for ``slots`` (meaningful where valid)."""
        return self._seq[slots]

    def invalidate(self, slots: Sequence[int]) -> None:
        """Mark slots empty (call before writing new bytes into them)."""
        idx = np.asarray(slots, dtype=np.int64)
        self._valid[idx] = False
        self._changed(idx)

    def _changed(self, idx: np.ndarray) -> None:
        """The records of slots ``idx`` (``int64``) just changed (nothing to do here)."""

    def sealed(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per slot of ``idx``: whether it is valid with its checksum known, its sequence
        hash and its checksum (the last two meaningful where the first is true)."""
        return self._valid[idx] & self._known[idx], self._seq[idx], self._checksum[idx]

    def record(self, slot: int, checksum: int | None, sequence_hash: int) -> None:
        """Mark ``slot`` valid, holding ``sequence_hash`` with payload hash ``checksum``
        (``None``: not computed yet)."""
        self._checksum[slot] = 0 if checksum is None else checksum
        self._known[slot] = checksum is not None
        self._device_known[slot] = False
        self._seq[slot] = sequence_hash
        self._valid[slot] = True
        self._changed(np.array([slot], dtype=np.int64))

    def record_many(self, slots: Sequence[int], checksums: Sequence[int | None] | None,
                    sequence_hashes: Sequence[int], device_sums: np.ndarray | None = None) -> None:
        """:meth:`record` for a batch (vectorized); ``checksums=None``: none computed yet;
        ``device_sums``: the blocks' device checksums, where the copy computed them."""
        idx = np.asarray(slots, dtype=np.int64)
        if device_sums is None:
            self._device_known[idx] = False
        else:
            self._device[idx] = np.asarray(device_sums, dtype=np.uint64)
            self._device_known[idx] = True
        if checksums is None:
            self._known[idx] = False
        elif not isinstance(checksums, np.ndarray) and any(c is None for c in checksums):
            for slot, value in zip(idx.tolist(), checksums):
                self._checksum[slot] = 0 if value is None else value
                self._known[slot] = value is not None
        else:
            self._checksum[idx] = np.asarray(checksums, dtype=np.uint64)
            self._known[idx] = True
        self._seq[idx] = np.asarray(sequence_hashes, dtype=np.uint64)
        self._valid[idx] = True
        self._changed(idx)

    def fill(self, slots: Sequence[int], checksums: Sequence[int | None],
             sequence_hashes: Sequence[int]) -> None:
        """Record late-computed checksums for slots that are still valid, still hold
        ``sequence_hashes`` and have none yet (others are left alone)."""
        filled = []
        for slot, value, seq in zip(slots, checksums, sequence_hashes):
            if (value is not None and self._valid[slot] and not self._known[slot]
                    and int(self._seq[slot]) == seq):
                self._checksum[slot] = value
                self._known[slot] = True
                filled.append(slot)
        self._changed(np.asarray(filled, dtype=np.int64))

    def device_sums_of(self, slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(sums, known)``: the device checksums recorded for ``slots`` and where one is
        (meaningful for valid slots only)."""
        idx = np.asarray(slots, dtype=np.int64)
        return self._device[idx], self._device_known[idx]

    def checksums_of(self, slots: Sequence[int]) -> list[int | None]:
        """Recorded checksums of ``slots`` (``None`` where not computed yet; meaningful for
        valid slots only)."""
        idx = np.asarray(slots, dtype=np.int64)
        values = self._checksum[idx].tolist()
        known = self._known[idx]
        if known.all():
            return values
        return [v if k else None for v, k in zip(values, known.tolist())]

    def check_identities(self, slots: Sequence[int],
                         sequence_hashes: Sequence[int]) -> list[BlockFailure]:
        """:meth:`check_identity` for a batch (vectorized); positions are batch indices."""
        idx = np.asarray(slots, dtype=np.int64)
        bad = ~self._valid[idx] | (self._seq[idx] != np.asarray(sequence_hashes, dtype=np.uint64))
        return [self.check_identity(int(p), int(idx[p]), sequence_hashes[p])
                for p in np.flatnonzero(bad)]

    def get(self, slot: int) -> tuple[int | None, int] | None:
        """``(checksum, sequence_hash)`` of a valid slot (checksum ``None`` if not computed
        yet), else ``None``."""
        if not self._valid[slot]:
            return None
        return (int(self._checksum[slot]) if self._known[slot] else None), int(self._seq[slot])

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

    def compare(self, positions: Sequence[int], slots: Sequence[int],
                actual: np.ndarray) -> list[BlockFailure]:
        """:meth:`check_bytes` for a batch whose payload hashes ``actual`` were computed
        already (valid slots only): failures where a recorded checksum differs; slots with
        none recorded yet take ``actual`` (trust on first use, as :meth:`check_bytes`)."""
        idx = np.asarray(slots, dtype=np.int64)
        actual = np.asarray(actual, dtype=np.uint64)
        known = self._known[idx]
        unknown = np.flatnonzero(~known)
        if unknown.size:
            self.fill(idx[unknown].tolist(), actual[unknown].tolist(),
                      self._seq[idx[unknown]].tolist())
        bad = np.flatnonzero(known & (self._checksum[idx] != actual))
        return [BlockFailure(int(positions[i]), int(idx[i]), FailureKind.CHECKSUM_MISMATCH,
                             f"xxh3-64 {int(actual[i]):#018x} != recorded "
                             f"{int(self._checksum[idx[i]]):#018x}") for i in bad]

    def check_bytes(self, position: int, slot: int, data) -> BlockFailure | None:
        """Failure record if ``data`` does not hash to the checksum recorded for ``slot``."""
        entry = self.get(slot)
        if entry is None:
            return BlockFailure(position, slot, FailureKind.NOT_WRITTEN,
                                "slot holds no valid block")
        actual = block_checksum(data)
        if entry[0] is None:
            # Deferred checksum never computed: nothing to compare against. Record it now so
            # later reads are verified against these bytes (trust on first use).
            self.fill([slot], [actual], [entry[1]])
            return None
        if actual != entry[0]:
            return BlockFailure(position, slot, FailureKind.CHECKSUM_MISMATCH,
                                f"xxh3-64 {actual:#018x} != recorded {entry[0]:#018x}")
        return None
