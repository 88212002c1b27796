"""A prefill-shaped worker in a process of its own, for tests and benchmarks of remote reads.

:func:`start_exporter` spawns a process that builds a :class:`~kvstrata.KvBlockManager`
(G1 stand-in + G2 of host memory), "computes" chains of blocks with payloads derived from
their sequence hashes (:func:`payload_of`: any process can regenerate the expected bytes),
exports G2 and answers commands on a pipe: ``("status",)`` -> lease counts and pool
activity; ``("quit",)``. The parent gets an :class:`ExporterProcess` with the control address
and the hashes it holds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..tiers import TOP_TIER, TierKind, first_of_kind

HOST = first_of_kind(TierKind.HOST)

__all__ = ["ExporterProcess", "start_exporter", "start_lease_holder", "payload_of",
           "geometry_config", "chain_tokens"]


def payload_of(sequence_hash: int, nbytes: int) -> np.ndarray:
    """The bytes the exporter stores for ``sequence_hash`` (deterministic)."""
    return np.random.default_rng(sequence_hash).integers(0, 256, nbytes, dtype=np.uint8)


def geometry_config(blocks: dict[str, int], *, block_size: int = 16, layers: int = 4,
                    kv_heads: int = 2, head_dim: int = 64, dtype: str = "bf16"):
    """A :class:`~kvstrata.config.KvConfig` with the given tier sizes in blocks."""
    from ..config import KvConfig, ModelGeometry, TierConfig

    return KvConfig(block_size=block_size, tiers={t: TierConfig(blocks=n)
                                                  for t, n in blocks.items()},
                    model=ModelGeometry(num_layers=layers, kv_heads=kv_heads,
                                        head_dim=head_dim, dtype=dtype))


@dataclass
class ExporterProcess:
    """Handle on a spawned exporter: ``control`` address, ``chains`` of sequence hashes it
    holds in G2, ``block_bytes`` of each payload."""

    process: Any
    conn: Any
    control: str
    chains: list[list[int]]
    block_bytes: int

    def status(self, timeout: float = 10.0) -> dict:
        self.conn.send(("status",))
        if not self.conn.poll(timeout):
            raise TimeoutError("exporter did not answer")
        return self.conn.recv()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask it to quit; kill it if it does not."""
        if self.process.is_alive():
            try:
                self.conn.send(("quit",))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self.conn.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)


def chain_tokens(chain: int, blocks: int, block_size: int) -> list[int]:
    """The prompt tokens of the exporter's chain number ``chain``."""
    return list(range(chain * 100_000, chain * 100_000 + blocks * block_size))


def start_exporter(chains: int = 2, chain_blocks: int = 8, g2_blocks: int = 64,
                   geometry: dict | None = None, events: str | None = None,
                   worker_id: int = 0, timeout: float = 60.0) -> ExporterProcess:
    """Spawn an exporter holding ``chains`` chains of ``chain_blocks`` blocks in G2
    (tokens :func:`chain_tokens`); with ``events`` (a sink spec such as
    ``nats://host:port/subject``) it publishes its block events as worker ``worker_id``."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_exporter_main,
                          args=(child, chains, chain_blocks, g2_blocks, geometry or {},
                                events, worker_id),
                          daemon=True)
    process.start()
    child.close()
    if not parent.poll(timeout):
        process.kill()
        raise TimeoutError("exporter process did not start")
    ready = parent.recv()
    if "error" in ready:
        process.join(5)
        raise RuntimeError(f"exporter failed: {ready['error']}")
    return ExporterProcess(process, parent, ready["control"], ready["chains"],
                           ready["block_bytes"])


def _exporter_main(conn, chains: int, chain_blocks: int, g2_blocks: int,
                   geometry: dict, events: str | None, worker_id: int) -> None:
    os.environ.setdefault("UCX_MODULES", "^ib")
    publisher = None
    try:
        from ..manager import KvBlockManager
        from ..tokens import hash_blocks
        from ..types import BlockRecord

        config = geometry_config({TOP_TIER: chains * chain_blocks, HOST: g2_blocks}, **geometry)
        if events:
            from ..events import make_publisher

            publisher = make_publisher(events, worker_id=worker_id)
        mgr = KvBlockManager(config, observers=[publisher] if publisher else ())
        bs = config.block_size
        nbytes = mgr.storage(TOP_TIER).config.block_bytes
        held = []
        for c in range(chains):
            tokens = chain_tokens(c, chain_blocks, bs)
            local, seqs = hash_blocks(tokens, bs)
            records = [BlockRecord(s, l, p, bs) for s, l, p in zip(seqs, local, [None, *seqs[:-1]])]
            blocks = mgr.allocate(len(records)).result(30)
            mgr.write_g1(blocks.block_ids, [payload_of(r.sequence_hash, nbytes) for r in records])
            blocks.apply_token_blocks(records)
            mgr.release(mgr.register(blocks).result(30)).result(30)
            held.append(list(seqs))
        mgr.wait_idle(30)
        if publisher is not None:
            publisher.flush(10)
        exporter = mgr.export(HOST)
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    conn.send({"control": exporter.control, "chains": held, "block_bytes": nbytes})
    try:
        while True:
            command = conn.recv()
            if command[0] == "quit":
                break
            if command[0] == "status":
                pool = mgr.status()["tiers"][HOST]["pool"]
                conn.send({"leases": len(exporter.leases), "expired": exporter.leases.expired,
                           "g2_active": pool["active"], "requests": exporter.requests})
    except EOFError:
        pass
    finally:
        exporter.close()
        mgr.close()
        if publisher is not None:
            publisher.close()


def start_lease_holder(control: str, hashes: list[int], ttl: float, timeout: float = 60.0):
    """Spawn a reader that leases ``hashes`` from ``control`` for ``ttl`` seconds and then
    hangs without releasing (a reader that will be killed). Returns the process once the
    lease is granted."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_holder_main, args=(child, control, hashes, ttl), daemon=True)
    process.start()
    child.close()
    if not parent.poll(timeout):
        process.kill()
        raise TimeoutError("lease holder did not start")
    granted = parent.recv()
    if isinstance(granted, str):
        process.join(5)
        raise RuntimeError(f"lease holder failed: {granted}")
    return process, granted


def _holder_main(conn, control: str, hashes: list[int], ttl: float) -> None:
    import time

    from ..remote.control import ControlChannel

    try:
        channel = ControlChannel(control, 10.0)      # kept open: the lease is its connection's
        reply = channel.call({
            "op": "lease", "hashes": np.asarray(hashes, "<u8").tobytes(), "ttl": ttl})
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send(len(reply.get("slots", b"")) // 8)
    time.sleep(3600)
