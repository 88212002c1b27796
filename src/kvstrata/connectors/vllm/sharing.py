"""Sharing G2 between vLLM engines over NIXL (``export`` and ``peers`` settings).

An engine with ``export: tcp://host:port`` serves its G2 from its worker process
(:class:`G2Export`): a :class:`~kvstrata.remote.BlockExporter` over the worker's G2 storage
whose leases pin slots in the storage itself (the pool lives in the scheduler process; a
pinned slot refuses to be overwritten, so a copy into it fails and that block is simply not
stored, and the scheduler never learns of the lease).

An engine with ``peers`` reads prefixes from them straight into vLLM's KV cache:

* its scheduler asks each peer how long a prefix of a request it holds
  (:class:`PeerDirectory`: in the background; vLLM is told "not yet" until the answers come
  or the ``peer_ask_timeout`` setting passes) and, when a peer holds more than the local tiers, has vLLM
  allocate the blocks and orders a remote load;
* its worker (:class:`RemoteLoader`) leases the prefix from the peer, reads it with NIXL into
  the engine's blocks, verified against the peer's checksums, and reports the request
  loaded; blocks that could not be read are reported as load errors (vLLM recomputes them).

The exporter and the loader start their threads (NIXL's and UCX's, their own) unbound
from vLLM's CPU binding (:func:`_unbound`). vLLM's CPU worker binds itself to its OpenMP
cores and every thread it starts inherits that, so two engines on one machine may hold all
their threads on the same core, next to vLLM's busy-waiting worker thread; there the threads
that connect UCX endpoints and answer peers waited seconds for the CPU and remote loads timed
out. They mostly sleep and do little when they wake: any core the process may use will do.

One worker per engine for now (tensor parallelism would pair each rank with the peer's same
rank).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from ...compat import compatibility_of
from ...remote.control import ControlChannel, parse_control
from ...remote.exporter import BlockExporter
from ...remote.importer import BlockSetImporter, RemotePeer, pack_hashes
from ...tiers import TierKind, first_of_kind
from .settings import ConnectorSettings

HOST = first_of_kind(TierKind.HOST)

__all__ = ["RemoteLoad", "G2Export", "RemoteLoader", "PeerDirectory"]

log = logging.getLogger(__name__)
T = TypeVar("T")

WARM_PATIENCE = 300.0
"""Seconds a reading engine keeps trying every 0.5 s to connect to a peer not up yet."""
KEEPALIVE = 60.0
"""Seconds between the questions that keep a connection to each peer open (the exporter
closes one idle for 120 s; a new one costs a handshake on some request's clock)."""
LEASE_MARGIN = 30.0
"""Seconds a remote load's lease outlasts its read timeout."""


@dataclass(frozen=True)
class RemoteLoad:
    """Read ``sequence_hashes`` from the peer at ``peer`` into the engine's ``block_ids``."""

    peer: str
    sequence_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]


def _fingerprint(settings: ConnectorSettings, rank: int, world_size: int) -> str:
    return compatibility_of(settings.kv, rank=rank, world_size=world_size,
                            block_layout=settings.block_layout).fingerprint


def _unbind_this_thread() -> None:
    """Allow the calling thread on every CPU the process may use (the kernel keeps it within
    the process's cpuset); threads it starts inherit that."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):           # no affinity API here: nothing was bound
        pass


def _unbound(make: Callable[[], T]) -> T:
    """``make()`` run on a thread unbound from the caller's CPU binding, so that the threads
    it starts (NIXL's progress thread, UCX's, an exporter's) are too."""
    with ThreadPoolExecutor(1, initializer=_unbind_this_thread) as pool:
        return pool.submit(make).result()


class G2Export:
    """The exporting engine's worker: its G2 served at ``settings.export``."""

    def __init__(self, settings: ConnectorSettings, g2, rank: int, world_size: int) -> None:
        self.storage = g2
        host, port = parse_control(settings.export)
        self.exporter = _unbound(lambda: BlockExporter(
            f"kvstrata-vllm-{settings.worker_id}-{rank}-{port}", HOST, g2, self._pin,
            self._unpin, fingerprint=_fingerprint(settings, rank, world_size), host=host,
            port=port))
        log.info("kvstrata: serving G2 to other engines at %s", self.exporter.control)

    def _pin(self, hashes: Sequence[int]):
        rows = self.storage.pin_held(hashes)
        return rows, [slot for _, slot, _ in rows]

    def _unpin(self, slots: list[int]) -> None:
        self.storage.unpin(slots)

    def close(self) -> None:
        self.exporter.close()


class RemoteLoader:
    """The reading engine's worker: remote loads into vLLM's KV cache (``g1``), one at a time
    on a thread; :meth:`finished` gives ``(request id, engine block ids not loaded)``."""

    def __init__(self, settings: ConnectorSettings, g1, rank: int, world_size: int) -> None:
        fingerprint = _fingerprint(settings, rank, world_size)
        self.importer = _unbound(lambda: BlockSetImporter(g1, fingerprint=fingerprint))
        self.read_timeout = settings.peer_read_timeout
        self._peers: dict[str, RemotePeer] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-remote-load",
                                        initializer=_unbind_this_thread)
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0

    def submit(self, req_id: str, load: RemoteLoad) -> None:
        self.pending += 1
        self._pool.submit(self._run, req_id, load)

    def _run(self, req_id: str, load: RemoteLoad) -> None:
        failed = list(load.block_ids)
        try:
            peer = self._peers.get(load.peer)
            if peer is None:
                # its control calls (block set, lease, release) get the read's patience:
                # the exporter answers them from a loaded engine's process too
                peer = self._peers[load.peer] = self.importer.connect(
                    load.peer, timeout=self.read_timeout)
            lease = peer.lease(load.sequence_hashes, self.read_timeout + LEASE_MARGIN)
            try:
                count = len(lease.blocks)
                if count:
                    peer.read(lease, load.block_ids[:count], timeout=self.read_timeout)
                failed = list(load.block_ids[count:])
            finally:
                peer.release(lease)
        except Exception as exc:       # a dead or refusing peer: every block recomputed
            log.warning("kvstrata: remote load of request %s from %s failed: %s", req_id,
                        load.peer, exc)
            stale = self._peers.pop(load.peer, None)
            if stale is not None:
                stale.close()
        self._done.put((req_id, failed))

    def finished(self) -> list[tuple[str, list[int]]]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(out)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.importer.close()


class PeerDirectory:
    """The reading engine's scheduler: asks the peers, in the background, how long a prefix
    of a request they hold (``has``; nothing pinned)."""

    def __init__(self, peers: Sequence[str], ask_timeout: float) -> None:
        self.peers = list(peers)
        self.ask_timeout = ask_timeout
        """Seconds a request waits for the answers before it is scheduled without them."""
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvstrata-peers")
        self._asked: dict[str, tuple[float, tuple[int, ...], Future]] = {}
        self._channels: dict[str, ControlChannel] = {}
        """One kept connection per peer: a question is one round trip, not a connection
        and a handshake (a channel reconnects by itself after a failure)."""
        self._channels_lock = threading.Lock()
        self._closed = threading.Event()
        # connect and prove the secret to each peer now, not on a request's clock (the
        # first question would spend the whole ask timeout on it on a busy machine)
        threading.Thread(target=self._keep_warm, name="kvstrata-peers-warm",
                         daemon=True).start()

    def best(self, req_id: str, hashes: Sequence[int]) -> tuple[str, int] | None:
        """``(peer, blocks)`` of the peer holding the longest prefix of ``hashes``, or
        ``(None, 0)`` if none does or they did not answer in time; None while asking."""
        key = tuple(hashes)
        asked = self._asked.get(req_id)
        if asked is None or asked[1] != key:
            self._asked[req_id] = (time.monotonic(), key,
                                   self._pool.submit(self._ask_all, list(key)))
            return None
        started, _, future = asked
        if not future.done():
            if time.monotonic() - started < self.ask_timeout:
                return None
            return ("", 0)
        return future.result()

    def forget(self, req_id: str) -> None:
        self._asked.pop(req_id, None)

    def _ask_all(self, hashes: list[int]) -> tuple[str, int]:
        best = ("", 0)
        for peer in self.peers:
            try:
                reply = self._channel(peer).call({"op": "has", "hashes": pack_hashes(hashes)})
            except Exception:
                continue
            held = reply.get("held")
            if isinstance(held, int) and not isinstance(held, bool) \
                    and best[1] < held <= len(hashes):
                best = (peer, held)
        return best

    def _keep_warm(self) -> None:
        """Open each peer's connection now, retrying every 0.5 s while one is not up yet
        (an engine starting beside this one; for :data:`WARM_PATIENCE` at most), then keep
        them open with a question every :data:`KEEPALIVE` seconds."""
        started = time.monotonic()
        while not self._closed.is_set():
            cold = 0
            for peer in self.peers:
                try:
                    self._channel(peer).call({"op": "has", "hashes": pack_hashes([0])})
                except Exception:
                    cold += 1
            patient = cold and time.monotonic() - started < WARM_PATIENCE
            self._closed.wait(0.5 if patient else KEEPALIVE)

    def _channel(self, peer: str) -> ControlChannel:
        with self._channels_lock:
            channel = self._channels.get(peer)
            if channel is None:
                channel = self._channels[peer] = ControlChannel(peer, self.ask_timeout)
            return channel

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._channels_lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
