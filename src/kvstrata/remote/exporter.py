"""The exporting side: a worker's tier of host memory, readable by other processes over NIXL.

:class:`BlockExporter` registers a memory storage (G2) with a NIXL agent, describes it as a
:class:`~.blockset.BlockSet`, and answers a small control protocol on a TCP port
(:mod:`.control`: msgpack maps framed by their length, one reply per request, echoing the
request's ``id`` if it has one):

* ``{"op": "blockset"}`` -> ``{"blockset": bytes}``;
* ``{"op": "lease", "hashes": <u64 LE bytes>, "ttl": s}`` -> ``{"lease": id, "ttl": s,
  "slots": <u64 LE bytes>, "checksums": <u64 LE bytes>}``: the slot and checksum of each block
  of the longest held prefix of ``hashes`` (``lease`` 0 and empty arrays when nothing is
  held; packed arrays, because a lease may name thousands of blocks);
* ``{"op": "has", "hashes": <u64 LE bytes>}`` -> ``{"held": n}``: how long a prefix is held
  now, nothing pinned (a reader deciding where to load from);
* ``{"op": "release", "lease": id}`` -> ``{"released": bool}``;
* anything else -> ``{"error": "..."}``.

The data never passes through this socket: readers pull bytes with NIXL reads of the slots a
lease names, then check them against the lease's checksums. A thread serves the port and
expires overdue leases (:mod:`.lease`) at least every ``tick`` seconds.

Nothing is answered to a connection that has not proved it holds the deployment's shared
secret (:mod:`.auth`; ``secret``, else ``$KVSTRATA_SHARING_SECRET`` or the file
``$KVSTRATA_SHARING_SECRET_FILE``): an exporter without one refuses to start. A lease belongs
to the connection that took it (released by it only, or when it closes; its id is random)
and one host holds a bounded number of leases and pinned blocks (:class:`~.lease.LeaseTable`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

from ..physical.storage.base import MemoryStorage
from ..protocol.layout_codec import SharedLayout
from ..secret import SECRET_ENV, SECRET_FILE_ENV, SecretError, resolve_secret
from .blockset import BlockSet
from .control import ControlServer, PeerId
from .errors import LeaseError
from .lease import LeaseTable
from .nixl_agent import NixlAgent

__all__ = ["BlockExporter", "MAX_REQUEST_BYTES", "MAX_LEASE_BLOCKS"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20
"""Largest control request read; a bigger one drops its connection unanswered."""
MAX_LEASE_BLOCKS = 65536
"""Most blocks one lease may ask for."""
PINNED_SHARE = 0.75
PINNED_SHARE_PER_HOST = 0.5
"""Shares of the exported tier's blocks that leases may pin, all readers together and one
reader's host: a quarter stays free to evict, so the tier's owner can always store new
blocks, and one host leaves room for the others. A lease asking more is cut short."""


class BlockExporter:
    """Export ``storage`` (a tier of memory) as block set ``name`` (see the module docstring).
    ``pin``/``unpin`` are the pool owner's (:class:`~.lease.LeaseTable`)."""

    def __init__(self, name: str, tier: str, storage: MemoryStorage,
                 pin: Callable[[Sequence[int]], tuple[list[tuple[int, int, int]], Any]],
                 unpin: Callable[[Any], None], *, fingerprint: str = "",
                 host: str = "127.0.0.1", port: int = 0, max_leases: int = 1024,
                 tick: float = 0.05, secret: bytes | None = None) -> None:
        try:
            secret = resolve_secret(secret)
        except SecretError as exc:
            raise LeaseError(f"exporter {name}: {exc}") from None
        if secret is None:
            raise LeaseError(f"exporter {name}: exporting memory needs the deployment's "
                             f"sharing secret (${SECRET_ENV}, or a file of the running "
                             f"user's named by ${SECRET_FILE_ENV}): nothing is served to a "
                             f"peer that cannot prove it holds it")
        self.name, self.tier = name, tier
        capacity = storage.layout.config.num_blocks
        self.leases = LeaseTable(
            pin, unpin, max_leases=max_leases,
            max_blocks_per_owner=int(capacity * PINNED_SHARE_PER_HOST),
            max_blocks=int(capacity * PINNED_SHARE))
        layout, regions = storage.layout, storage.descriptors()
        self._agent = NixlAgent(name)
        self._closed = False
        self.requests = 0
        self._server: ControlServer | None = None
        try:
            self._agent.register([(r.address, r.size) for r in regions], regions[0].memory_kind,
                                 regions[0].device_id or 0)
            self._server = ControlServer(host, port, self._answer_bytes,
                                         max_request=MAX_REQUEST_BYTES, tick=tick,
                                         on_tick=self.leases.expire,
                                         name=f"kvstrata-export-{name}", secret=secret,
                                         on_close=lambda peer: self.leases.release_owner(
                                             peer.ident),
                                         holds=lambda peer: self.leases.holds(peer.ident))
            self.control = self._server.address
            self.blockset = BlockSet(name, tier, SharedLayout(layout, tuple(regions)),
                                     self._agent.metadata(), self.control, fingerprint)
            self._encoded = self.blockset.encode()
        except Exception:
            if self._server is not None:
                self._server.close()
            self._agent.close()
            raise
        self._server.start()

    # -- serving (on the control server's thread) ------------------------------------------
    def _answer_bytes(self, body: bytes, peer: PeerId = PeerId(0, "")) -> bytes:
        return msgpack.packb(self._answer(body, peer))

    def _answer(self, body: bytes, peer: PeerId = PeerId(0, "")) -> dict:
        """The reply to one request of connection ``peer``, echoing its ``id``."""
        self.requests += 1
        try:
            request = msgpack.unpackb(body, raw=False, max_bin_len=MAX_REQUEST_BYTES)
        except Exception:
            return {"error": "request is not msgpack"}
        if not isinstance(request, dict):
            return {"error": "request must be a map"}
        reply = self._reply(request, peer)
        if "id" in request:
            reply["id"] = request["id"]
        return reply

    def _reply(self, request: dict, peer: PeerId) -> dict:
        op = request.get("op")
        try:
            if op == "blockset":
                return {"blockset": self._encoded}
            if op == "lease":
                return self._lease(request, peer)
            if op == "has":
                return self._has(request)
            if op == "release":
                lease_id = request.get("lease")
                if not isinstance(lease_id, int) or isinstance(lease_id, bool):
                    return {"error": "release needs an int lease"}
                return {"released": self.leases.release(lease_id, peer.ident)}
            return {"error": f"unknown op {op!r:.40}"}
        except LeaseError as exc:
            return {"error": str(exc)}
        except Exception as exc:          # never let a request kill the exporter
            log.exception("kvstrata: exporter %s failed a %s request", self.name, op)
            return {"error": f"internal error: {type(exc).__name__}"}

    @staticmethod
    def _hashes(request: dict) -> list[int] | None:
        raw = request.get("hashes")
        if not isinstance(raw, bytes) or not raw or len(raw) % 8 \
                or len(raw) // 8 > MAX_LEASE_BLOCKS:
            return None
        return np.frombuffer(raw, "<u8").tolist()

    def _has(self, request: dict) -> dict:
        """How long a prefix of the hashes is held now (nothing pinned)."""
        hashes = self._hashes(request)
        if hashes is None:
            return {"error": f"has needs 1..{MAX_LEASE_BLOCKS} hashes as little-endian u64 "
                             f"bytes"}
        return {"held": self.leases.held(hashes)}

    def _lease(self, request: dict, peer: PeerId) -> dict:
        hashes, ttl = self._hashes(request), request.get("ttl")
        if hashes is None:
            return {"error": f"lease needs 1..{MAX_LEASE_BLOCKS} hashes as little-endian u64 "
                             f"bytes"}
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not ttl > 0:
            return {"error": "lease needs a ttl > 0 seconds"}
        lease = self.leases.grant(hashes, float(ttl), peer.ident, peer.host)
        if lease is None:
            return {"lease": 0, "ttl": 0.0, "slots": b"", "checksums": b""}
        rows = np.array([(b[1], b[2]) for b in lease.blocks], dtype="<u8")
        return {"lease": lease.lease_id, "ttl": lease.ttl,
                "slots": rows[:, 0].tobytes(), "checksums": rows[:, 1].tobytes()}

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving, unpin every lease, deregister the memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        self.leases.close()
        self._agent.close()

    def __enter__(self) -> "BlockExporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
