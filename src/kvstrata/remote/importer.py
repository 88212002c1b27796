"""The importing side: read blocks out of another process's exported memory, verified.

(About 500 lines on purpose: one concern, reading a peer's blocks verified; the batched copy and
the hashing that overlaps it (either thread may hash a batch) are one pipeline.)

:class:`BlockSetImporter` owns this process's NIXL agent with its own storage registered (the
tier blocks are read into). :meth:`BlockSetImporter.connect` fetches a peer's block set from
its control address (or :meth:`BlockSetImporter.import_blockset` takes the bytes), validates
it and checks it against the local layout and fingerprint *before* any byte moves, and
returns a :class:`RemotePeer`.

A read goes: :meth:`RemotePeer.lease` (the exporter pins the longest prefix it holds and
names each block's slot and checksum), :meth:`RemotePeer.read` (NIXL reads of a few MiB at a time,
each batch hashed on a second thread while the next one is copied and compared with the lease's checksums; the local
slots are invalidated before and sealed only after a block verified), :meth:`RemotePeer.release`. A
read that fails -- the exporter died or disconnected, the lease ran out first, a checksum
differs -- raises :class:`~.errors.RemoteReadError` and seals nothing: wrong bytes are never
handed on.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import queue
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass
from typing import Sequence

import msgpack
import numpy as np
import xxhash

from ..physical import checksum as _checksum
from ..physical.checksum import native_range_checksums
from ..physical.storage.base import MemoryStorage
from ..protocol.layout_codec import SharedLayout
from .blockset import BlockSet, byte_ranges, decode
from .control import ControlChannel
from .errors import BlockSetFormatError, LeaseError, RemoteReadError
from .nixl_agent import NixlAgent

__all__ = ["BlockSetImporter", "RemotePeer", "RemoteLease", "pack_hashes", "ask"]

_names = itertools.count(1)
BATCH_BYTES = 4 << 20
"""A verified read is copied and hashed in batches of about this many bytes (at least one
block): small enough to be hashed from the CPU's cache right after it arrives."""
LAG_BATCHES = 2
"""Batches a verified read lets wait for the verifying thread; beyond that (it gets no CPU)
the reading thread hashes one itself (with the Python hand-over the one it has just copied,
with the native one the oldest). One batch of lag is normal: the verifying thread needs a
wake-up (and, with the Python hand-over, the GIL) before it takes a batch."""


@dataclass(frozen=True)
class RemoteLease:
    """A lease as the reader holds it: ``blocks`` are ``(sequence_hash, remote_slot,
    checksum)``; ``expires`` is this process's monotonic time by which the read must end
    (the lease's ttl counted from before the request was sent)."""

    lease_id: int
    blocks: tuple[tuple[int, int, int], ...]
    expires: float

    @property
    def sequence_hashes(self) -> list[int]:
        return [b[0] for b in self.blocks]


class BlockSetImporter:
    """This process's side of remote reads into ``storage`` (see the module docstring).
    ``fingerprint`` (see :mod:`kvstrata.compat`), when given, must equal the exporter's."""

    def __init__(self, storage: MemoryStorage, *, name: str | None = None,
                 fingerprint: str | None = None) -> None:
        self.storage = storage
        self.fingerprint = fingerprint
        self.name = name or f"kvstrata-import-{id(self):x}-{next(_names)}"
        self._shared = SharedLayout(storage.layout, storage.descriptors())
        self._memory = _LocalMemory(self._shared)
        self._agent = NixlAgent(self.name)
        regions = self._shared.regions
        self._agent.register([(r.address, r.size) for r in regions], regions[0].memory_kind,
                             regions[0].device_id or 0)
        self._peers: list[RemotePeer] = []
        # started now, on the constructing thread: it inherits that thread's CPU binding,
        # not that of whichever thread reads first (an engine's worker may be pinned)
        self._verifier = _Verifier(self.name)

    def connect(self, control: str, timeout: float = 5.0) -> "RemotePeer":
        """Fetch the block set served at ``control`` (``tcp://host:port``) and import it."""
        channel = ControlChannel(control, timeout)
        try:
            reply = channel.call({"op": "blockset"})
            data = reply.get("blockset")
            if not isinstance(data, bytes):
                raise BlockSetFormatError(f"{control} answered no block set: {reply!r:.80}")
            return self._import(decode(data), channel)
        except BaseException:
            channel.close()
            raise

    def import_blockset(self, data: bytes) -> "RemotePeer":
        """Import a serialized block set (its control address is used for leases)."""
        blockset = decode(data)
        channel = ControlChannel(blockset.control, 5.0)
        try:
            return self._import(blockset, channel)
        except BaseException:
            channel.close()
            raise

    def _import(self, blockset: BlockSet, channel: "ControlChannel") -> "RemotePeer":
        blockset.require_compatible(self.storage.layout, self.fingerprint)
        name = self._agent.add_remote(blockset.agent_metadata)
        if name != blockset.name:
            self._agent.remove_remote(name)
            raise BlockSetFormatError(f"block set names agent {blockset.name!r} but its "
                                      f"metadata is agent {name!r}")
        peer = RemotePeer(self, blockset, channel)
        self._peers.append(peer)
        return peer

    def _copy_verified(self, peer: str, local: list, remote: list, per_block: int,
                       checksums: Sequence[int] | None, timeout: float,
                       memory_kind: str) -> list[int]:
        """Copy ``remote`` into ``local`` (``per_block`` ranges a block) and return the
        indices of the blocks whose bytes do not hash to ``checksums`` (None: not checked).

        Unchecked, it is one transfer. Checked, it goes in batches of about
        :data:`BATCH_BYTES` (a :class:`_VerifyJob`): the importer's verifying thread hashes
        each batch that has arrived while this thread copies the next one (NIXL copies on
        the thread that posts), so the hash pass hides behind the copy where a second core
        is free. Where it is not, the verifying thread falls behind and this thread hashes
        the batch it has just copied itself, from its cache, before copying the next. Every
        batch is hashed before this returns or raises, so nothing reads the slots afterwards.
        :class:`RemoteReadError` from the first batch whose copy failed."""
        blocks = len(local) // per_block
        if checksums is None:
            self._agent.read(peer, local, remote, timeout, memory_kind)
            return []
        block_bytes = sum(n for _, n in local[:per_block])
        step = max(1, BATCH_BYTES // max(1, block_bytes))
        deadline = time.monotonic() + timeout
        native = _checksum.BATCH_VERIFIER is not None
        job = (_NativeVerifyJob(self._memory, local, per_block, checksums, step) if native
               else _VerifyJob(self._memory, local, per_block, checksums))
        if native:
            self._verifier.wake(job)          # once: it hashes each batch as it arrives
        try:
            for first in range(0, blocks, step):
                stop = min(first + step, blocks)
                lo, hi = first * per_block, stop * per_block
                self._agent.read(peer, local[lo:hi], remote[lo:hi],
                                 max(1e-3, deadline - time.monotonic()), memory_kind)
                job.add(first, stop)
                if job.waiting() > LAG_BATCHES:   # the verifying thread is behind: help it
                    job.hash_newest()
                elif not native:
                    self._verifier.wake(job)
        finally:
            job.finish()
        if job.error is not None:
            raise RemoteReadError(f"verifying a read from {peer!r} failed: "
                                  f"{type(job.error).__name__}: {job.error}")
        return sorted(job.bad)

    def close(self) -> None:
        """Close every peer and the agent. Idempotent."""
        for peer in self._peers:
            peer.close()
        self._peers = []
        self._agent.close()
        self._verifier.close()
        self._memory = None             # views into the storage: not past its lifetime


class RemotePeer:
    """One imported block set: lease, read and release its blocks."""

    def __init__(self, importer: BlockSetImporter, blockset: BlockSet,
                 channel: "ControlChannel") -> None:
        self.importer = importer
        self.blockset = blockset
        self._channel = channel
        self.closed = False

    def lease(self, sequence_hashes: Sequence[int], ttl: float = 10.0) -> RemoteLease:
        """Ask the exporter to pin the longest prefix of ``sequence_hashes`` it holds;
        the lease may name fewer blocks (none: nothing held)."""
        hashes = np.frombuffer(pack_hashes(sequence_hashes), "<u8")
        started = time.monotonic()
        reply = self._channel.call({"op": "lease", "hashes": hashes.tobytes(),
                                    "ttl": float(ttl)})
        if "error" in reply:
            raise LeaseError(f"{self.blockset.name}: {reply['error']}")
        lease_id, granted = reply.get("lease"), reply.get("ttl")
        slots, checksums = reply.get("slots"), reply.get("checksums")
        # a lease lasts no longer than asked: NaN or inf from a broken exporter would
        # turn off every expiry check below
        if not isinstance(lease_id, int) or isinstance(lease_id, bool) \
                or not isinstance(granted, (int, float)) or isinstance(granted, bool) \
                or not 0 <= granted <= float(ttl) or not isinstance(slots, bytes) \
                or not isinstance(checksums, bytes) or len(slots) != len(checksums) \
                or len(slots) % 8 or len(slots) // 8 > hashes.size:
            raise LeaseError(f"{self.blockset.name}: malformed lease reply")
        count = len(slots) // 8
        rows = zip(hashes[:count].tolist(), np.frombuffer(slots, "<u8").tolist(),
                   np.frombuffer(checksums, "<u8").tolist())
        return RemoteLease(lease_id, tuple(rows), started + float(granted))

    def held(self, sequence_hashes: Sequence[int]) -> int:
        """How long a prefix of ``sequence_hashes`` the exporter holds now (no lease)."""
        reply = self._channel.call({"op": "has", "hashes": pack_hashes(sequence_hashes)})
        held = reply.get("held")
        if "error" in reply or not isinstance(held, int) or isinstance(held, bool) \
                or not 0 <= held <= len(sequence_hashes):
            raise LeaseError(f"{self.blockset.name}: {reply.get('error', 'malformed reply')}")
        return held

    def read(self, lease: RemoteLease, local_slots: Sequence[int], timeout: float = 30.0,
             verify: bool = True) -> list[int]:
        """Read the first ``len(local_slots)`` blocks of ``lease`` into those slots of the
        importer's storage, verify each against its checksum, seal them (when the storage
        keeps checksums) and return the checksums. :class:`RemoteReadError` if anything
        fails; then no slot is sealed and their old contents are invalid.

        ``verify=False`` skips hashing what arrived (a pass over every byte: on a machine
        with no spare core it costs about as much as the copy) and trusts the lease, which
        keeps the blocks from being rewritten; the slots are sealed with the exporter's
        checksums, so a later verified read of them still catches bad bytes."""
        if self.closed:
            raise RemoteReadError("peer is closed")
        slots = [int(s) for s in local_slots]
        if len(slots) > len(lease.blocks):
            raise ValueError(f"{len(slots)} slots for a lease of {len(lease.blocks)} blocks")
        if not slots:
            return []
        remaining = lease.expires - time.monotonic()
        if remaining <= 0:
            raise LeaseError(f"lease {lease.lease_id} expired before the read")
        storage = self.importer.storage
        local_shared = self.importer._shared
        blocks = lease.blocks[:len(slots)]
        granularity = max(self.blockset.layout.contiguous_granularity,
                          local_shared.layout.contiguous_granularity)
        remote = self.blockset.block_ranges([b[1] for b in blocks], granularity)
        local = byte_ranges(local_shared, slots, granularity)
        begin = getattr(storage, "begin_write", None)
        if begin is not None:
            begin(slots)
        bad = self.importer._copy_verified(
            self.blockset.name, local, remote, len(local) // len(slots),
            [b[2] for b in blocks] if verify else None, min(timeout, remaining),
            local_shared.regions[0].memory_kind)
        if time.monotonic() > lease.expires:
            raise RemoteReadError(f"lease {lease.lease_id} expired during the read: the "
                                  f"exporter may have reused the blocks")
        if bad:
            raise RemoteReadError(f"{len(bad)} block(s) read from {self.blockset.name!r} do "
                                  f"not match their checksums (first at position {bad[0]})")
        checksums = [b[2] for b in blocks]
        seal = getattr(storage, "seal", None)
        if seal is not None:
            seal(slots, [b[0] for b in blocks], checksums)
        return checksums

    def release(self, lease: RemoteLease, wait: bool = False) -> bool | None:
        """Tell the exporter the lease is done. By default without waiting for its answer
        (None: the reader has its bytes, the unpinning is the exporter's business); with
        ``wait``, whether the exporter still had the lease (False: expired or unknown)."""
        if lease.lease_id == 0:
            return False if wait else None
        reply = self._channel.call({"op": "release", "lease": lease.lease_id}, wait=wait)
        return bool(reply.get("released")) if wait else None

    def close(self) -> None:
        """Forget the exporter (idempotent); outstanding leases expire on its side."""
        if not self.closed:
            self.closed = True
            self._channel.close()
            self.importer._agent.remove_remote(self.blockset.name)


def pack_hashes(sequence_hashes: Sequence[int]) -> bytes:
    """Sequence hashes as little-endian u64 bytes; ``ValueError`` unless a non-empty
    sequence of u64."""
    try:
        hashes = np.asarray(sequence_hashes, dtype="<u8")
    except (OverflowError, TypeError, ValueError):
        raise ValueError("sequence hashes must be u64") from None
    if hashes.ndim != 1 or not hashes.size:
        raise ValueError("expected a non-empty sequence of u64 sequence hashes")
    return hashes.tobytes()


def ask(control: str, request: dict, timeout: float) -> dict:
    """One request to the exporter at ``control`` on a connection of its own (closed
    after): for callers that do not keep a peer, e.g. asking several exporters what they
    hold. :class:`LeaseError` if it does not answer in time."""
    channel = ControlChannel(control, timeout)
    try:
        return channel.call(request)
    finally:
        channel.close()


class _LocalMemory:
    """Byte views of the importer's own registered regions, made once (a view per block
    read would cost more than hashing a small block)."""

    def __init__(self, shared: SharedLayout) -> None:
        regions = sorted((r.address, r.size) for r in shared.regions)
        self._bases = [a for a, _ in regions]
        self._base_array = np.array(self._bases, dtype=np.uint64)
        self._size_array = np.array([n for _, n in regions], dtype=np.uint64)
        self._views = [memoryview((ctypes.c_char * n).from_address(a)).cast("B")
                       for a, n in regions]

    def view(self, address: int, length: int) -> memoryview:
        i = bisect_right(self._bases, address) - 1
        offset = address - self._bases[i]
        return self._views[i][offset:offset + length]

    def arrays(self, ranges: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """``ranges`` as contiguous uint64 arrays of addresses and lengths, after checking
        that each lies inside a registered region (``ValueError`` if not): hashing reads
        them by address."""
        pairs = np.array(ranges, dtype=np.uint64).reshape(-1, 2)
        addresses = np.ascontiguousarray(pairs[:, 0])
        lengths = np.ascontiguousarray(pairs[:, 1])
        region = np.searchsorted(self._base_array, addresses, side="right") - 1
        inside = region >= 0
        region = np.maximum(region, 0)
        offsets = addresses - self._base_array[region]
        sizes = self._size_array[region]
        if not (inside & (offsets <= sizes) & (lengths <= sizes - offsets)).all():
            raise ValueError("a range to hash lies outside the registered memory")
        return addresses, lengths

    def checksums(self, addresses: np.ndarray, lengths: np.ndarray,
                  per_block: int) -> np.ndarray:
        """xxh3-64 of each block's bytes, a block being ``per_block`` consecutive ranges of
        :meth:`arrays` concatenated: in one native call with the GIL let go where it is
        built, else range by range."""
        sums = native_range_checksums(addresses, lengths, per_block)
        if sums is not None:
            return sums
        ranges = list(zip(addresses.tolist(), lengths.tolist()))
        return np.array([self.checksum(ranges[i:i + per_block])
                         for i in range(0, len(ranges), per_block)], dtype=np.uint64)

    def checksum(self, ranges: Sequence[tuple[int, int]]) -> int:
        """xxh3-64 of the bytes at ``ranges``, concatenated in order."""
        if len(ranges) == 1:
            return xxhash.xxh3_64_intdigest(self.view(*ranges[0]))
        h = xxhash.xxh3_64()
        for address, length in ranges:
            h.update(self.view(address, length))
        return h.intdigest()


class _VerifyJob:
    """The batches of one verified read that have arrived and are not hashed yet, shared by
    the reading thread and the importer's verifying thread. The verifying thread takes the
    oldest batch; the reading thread, when the verifier falls behind (no spare core), takes
    the newest, which it has just copied and still holds in its cache."""

    def __init__(self, memory: "_LocalMemory", local: list, per_block: int,
                 checksums: Sequence[int]) -> None:
        self._memory, self._per_block = memory, per_block
        self._addresses, self._lengths = memory.arrays(local)        # checked once, here
        self._expected = np.array(checksums, dtype=np.uint64)
        self._todo: collections.deque[tuple[int, int]] = collections.deque()
        self._busy = 0                              # batches taken and not yet hashed
        self._idle = threading.Condition()
        self.bad: list[int] = []
        self.error: BaseException | None = None

    def add(self, first: int, stop: int) -> None:
        """Blocks ``[first, stop)`` have arrived."""
        self._todo.append((first, stop))

    def waiting(self) -> int:
        """Batches arrived and not taken by either thread."""
        return len(self._todo)

    def serve(self) -> None:
        """Hash the oldest waiting batch, if any (the verifying thread, once per wake-up)."""
        self._hash(self._todo.popleft)

    def hash_newest(self) -> None:
        """Hash the newest waiting batch, if any (the reading thread)."""
        self._hash(self._todo.pop)

    def finish(self) -> None:
        """Hash what is still waiting on this thread, then wait for the batch the verifying
        thread may be hashing."""
        while self._todo:
            self.hash_newest()
        with self._idle:
            self._idle.wait_for(lambda: not self._busy)

    def _hash(self, take) -> None:
        with self._idle:
            try:
                first, stop = take()
            except IndexError:                      # the other thread took it
                return
            self._busy += 1
        try:
            if self.error is None:
                per = self._per_block
                sums = self._memory.checksums(self._addresses[first * per:stop * per],
                                              self._lengths[first * per:stop * per], per)
                differ = np.flatnonzero(sums != self._expected[first:stop])
                self.bad.extend((differ + first).tolist())
        except BaseException as exc:
            self.error = exc
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()


class _NativeVerifyJob:
    """:class:`_VerifyJob`'s contract with the hand-over in C (``verify_batches`` in
    ``_tokenhash.c``): the verifying thread is woken once per read and hashes each batch as
    the reading thread reports it arrived, never taking the GIL, so the reading thread never
    waits for it between copies (handing over each batch in Python cost ~0.6 ms of a 13 ms
    read of 128 MiB). Batches are claimed oldest first by either thread."""

    def __init__(self, memory: "_LocalMemory", local: list, per_block: int,
                 checksums: Sequence[int], step: int) -> None:
        self._addresses, self._lengths = memory.arrays(local)        # checked once, here
        self._expected = np.array(checksums, dtype=np.uint64)
        self._bad = np.zeros(len(self._expected), dtype=np.uint8)
        self._state = np.zeros(4, dtype=np.uint32)     # arrived | finished, claimed, done, failed
        self._per_block, self._step = per_block, step
        self._arrived = 0
        self._verify, self._report = _checksum.BATCH_VERIFIER
        self.error: BaseException | None = None

    def add(self, first: int, stop: int) -> None:
        """Blocks ``[first, stop)`` (the next batch) have arrived."""
        self._arrived += 1
        self._report(self._state, self._arrived, False)

    def waiting(self) -> int:
        """Batches arrived and not taken by either thread."""
        return self._arrived - int(self._state[1])

    def serve(self) -> None:
        """Hash batches as they arrive until :meth:`finish` (the verifying thread)."""
        self._call(0)

    def hash_newest(self) -> None:
        """Hash the oldest waiting batch (the reading thread, when the verifier is behind)."""
        self._call(1)

    def finish(self) -> None:
        """Hash what is left, then wait for the batch the verifying thread may be hashing."""
        try:
            self._call(2)
        finally:
            if not self._state[0] & 0x80000000:   # the call failed: let the thread go anyway
                self._report(self._state, self._arrived, True)
        if self._state[3] and self.error is None:
            self.error = MemoryError("no xxh3 streaming state")

    @property
    def bad(self) -> list[int]:
        return np.flatnonzero(self._bad).tolist()

    def _call(self, mode: int) -> None:
        try:
            self._verify(self._state, self._addresses, self._lengths, self._expected, self._bad,
                         self._per_block, self._step, mode, LAG_BATCHES)
        except BaseException as exc:
            self.error = exc


class _Verifier:
    """The importer's verifying thread: hashes the batches of verified reads
    (:class:`_VerifyJob`) that have arrived while the reading thread copies the next one.
    A plain thread woken through a queue: an executor's hand-over cost a few microseconds
    more, and a read hands over a batch every few hundred microseconds."""

    def __init__(self, name: str) -> None:
        self._wakeups: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-verify", daemon=True)
        self._thread.start()

    def wake(self, job: "_VerifyJob | _NativeVerifyJob") -> None:
        """Serve ``job``: a :class:`_VerifyJob`'s oldest waiting batch, if one is still
        waiting when this thread gets to it; a :class:`_NativeVerifyJob`'s batches until it
        finishes."""
        self._wakeups.put(job)

    def _run(self) -> None:
        while True:
            job = self._wakeups.get()
            if job is None:
                return
            job.serve()

    def close(self) -> None:
        """Stop the thread after the wake-ups already given. Idempotent."""
        if self._thread.is_alive():
            self._wakeups.put(None)
            self._thread.join()
