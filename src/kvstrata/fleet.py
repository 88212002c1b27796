"""Replay a trace over N workers that share one object tier (``kvstrata replay --workers N``).

Each worker is what one engine process would run: its own planner over its own G1, G2 and G3
(sized by the config), and a catalog of the shared G4 (``tiers.G4``; added with
:data:`SHARED_DEFAULT_BLOCKS` blocks if the config has none). Requests are spread over the
workers by a routing rule:

* ``round-robin`` -- request *i* goes to worker *i mod N*;
* ``prefix`` -- a router that follows every worker's block events in a
  :class:`~kvstrata.events.indexer.PrefixIndex` (the indexer ``kvstrata indexer`` serves)
  sends a request to the worker holding the longest prefix of it in its own tiers (G1-G3),
  among the workers not loaded more than :data:`LOAD_SLACK` above the average (requests
  served so far), the least loaded on a tie. Without the bound every request of a trace
  whose prompts share a first block would go to one worker.

**Sharing.** A block one worker stores into G4 becomes known to every other worker at once
(as its stored event would tell them; a real deployment also lists the store), so another
worker's request for it is served from G4 instead of recomputed. With ``shared=False`` each
worker only knows what it stored itself: N isolated workers, the baseline the sharing is
measured against. Every G4 hit is counted as served from the worker's own blocks or from
blocks another worker put.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from .config import KvConfig, TierConfig
from .events.indexer import PrefixIndex
from .events.model import RemovedEvent, StoredBlock, StoredEvent
from .logical.registry import RegistryObserver
from .placement import Planner
from .replay import (ReplayResult, ReplayWorker, RequestHasher, TraceRequest, hit_summary,
                     replay_config)
from .tiers import Addressing, TIERS, ordered
from .types import BlockRecord

__all__ = ["ROUTES", "SHARED_DEFAULT_BLOCKS", "FleetResult", "PrefixRouter", "replay_fleet",
           "shared_tier", "with_shared_tier"]

ROUTES = ("round-robin", "prefix")
LOAD_SLACK = 0.10
"""How far above the average load a worker may be and still be chosen for its prefix."""
SHARED_DEFAULT_BLOCKS = 100_000
"""Blocks of the shared tier each worker tracks when the config does not size it."""


MAX_WORKERS = 1024
"""Most workers a fleet replay runs (each has its own pools and planner in this process)."""


def check_workers(workers: object) -> int:
    """``workers`` if it is a worker count a fleet replay runs (1..:data:`MAX_WORKERS`);
    else ``ValueError`` saying the bound, before anything is allocated."""
    if isinstance(workers, bool) or not isinstance(workers, int) or not \
            1 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers must be an integer in 1..{MAX_WORKERS:,}, got "
                         f"{workers!r:.40}")
    return workers


def shared_tier() -> str:
    """The tier the workers share: the key-addressed one (G4)."""
    return next(s.name for s in TIERS if s.addressing is Addressing.KEYS)


def with_shared_tier(config: KvConfig) -> KvConfig:
    """``config`` with the shared tier, :data:`SHARED_DEFAULT_BLOCKS` big if it had none.
    An added shared tier admits every block and the tier that was the bottom keeps its
    filter: the fleet's tiers filter as one worker's did."""
    tier = shared_tier()
    if tier in config.tiers:
        return config
    bottom = ordered(config.tiers)[-1]
    tiers = {**config.tiers,
             bottom: replace(config.tiers[bottom], admission=config.tier_admission(bottom)),
             tier: TierConfig(blocks=SHARED_DEFAULT_BLOCKS, admission="always")}
    return replace(config, tiers=tiers)


@dataclass
class FleetResult:
    """What a fleet replay measured: one :class:`~kvstrata.replay.ReplayResult` per worker,
    and per worker the blocks it loaded from the shared tier that another worker put."""

    trace: str
    granularity: str
    block_size: int
    route: str
    shared: bool
    workers: list[ReplayResult] = field(default_factory=list)
    from_others: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0
    curve: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(w.requests for w in self.workers)

    @property
    def blocks(self) -> int:
        return sum(w.blocks for w in self.workers)

    @property
    def tokens(self) -> int:
        return sum(w.tokens for w in self.workers)

    @property
    def blocks_hit(self) -> int:
        return sum(w.blocks_hit for w in self.workers)

    @property
    def tokens_hit(self) -> int:
        return sum(w.tokens_hit for w in self.workers)

    def tier_hits(self, tier: str) -> int:
        return sum(w.tiers[tier].blocks_hit for w in self.workers if tier in w.tiers)

    def as_dict(self) -> dict:
        tier = shared_tier()
        return {
            "trace": self.trace, "granularity": self.granularity,
            "block_size": self.block_size, "workers": len(self.workers), "route": self.route,
            "shared": self.shared, **hit_summary(self),
            "shared_tier": {"tier": tier, "blocks_hit": self.tier_hits(tier),
                            "from_other_workers": sum(self.from_others)},
            "per_worker": [{"worker": i, **hit_summary(w),
                            "tiers": {n: t.as_dict() for n, t in w.tiers.items()},
                            "from_other_workers": self.from_others[i]}
                           for i, w in enumerate(self.workers)],
            "wall_seconds": round(self.wall_seconds, 4),
        }


def replay_fleet(requests: Iterable[TraceRequest], config: KvConfig, *, workers: int,
                 route: str = "round-robin", granularity: str = "trace", shared: bool = True,
                 trace_name: str = "<requests>",
                 progress: Callable[[int], None] | None = None,
                 curve_every: int = 0) -> FleetResult:
    """Replay ``requests`` over ``workers`` workers (see the module docstring)."""
    check_workers(workers)
    if route not in ROUTES:
        raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
    tier = shared_tier()
    config = with_shared_tier(config)
    hasher = RequestHasher(config.block_size, granularity)
    config = replay_config(config, hasher).validate()
    fleet = _Fleet(config, workers, tier, shared)
    result = FleetResult(trace_name, granularity, hasher.block_size, route, shared,
                         [w.result for w in fleet.workers], fleet.from_others)
    router = PrefixRouter([w.planner.registry for w in fleet.workers], tier) \
        if route == "prefix" else None
    started = time.perf_counter()
    for n, request in enumerate(requests):
        records, token_counts = hasher.records(request)
        index = router.choose(records, [w.result.requests for w in fleet.workers]) \
            if router is not None else n % workers
        fleet.serve(index, records, token_counts)
        if progress is not None:
            progress(n + 1)
        if curve_every and (n + 1) % curve_every == 0:
            result.curve.append((n + 1, _rates(result, tier)))
    result.wall_seconds = time.perf_counter() - started
    for worker in fleet.workers:
        worker.finish()
    if curve_every and (not result.curve or result.curve[-1][0] != result.requests):
        result.curve.append((result.requests, _rates(result, tier)))
    return result


def _rates(result: FleetResult, tier: str) -> dict[str, float]:
    blocks = result.blocks
    return {"total": result.blocks_hit / blocks if blocks else 0.0,
            tier: result.tier_hits(tier) / blocks if blocks else 0.0,
            "from other workers": sum(result.from_others) / blocks if blocks else 0.0}


class _Fleet:
    """The workers, and the shared tier's bookkeeping between them."""

    def __init__(self, config: KvConfig, n: int, tier: str, shared: bool) -> None:
        self.tier = tier
        self.shared = shared
        self.workers = [ReplayWorker(Planner(config, worker=i), config,
                                     ReplayResult("", "", config.block_size))
                        for i in range(n)]
        self.from_others = [0] * n
        self.own: list[set[int]] = [set() for _ in range(n)]
        """Per worker, the blocks it stored in the shared tier itself."""
        self._learning = False
        for i, worker in enumerate(self.workers):
            worker.planner.registry.add_observer(_SharedStore(self, i))

    def serve(self, index: int, records: list[BlockRecord], token_counts: Sequence[int]) -> None:
        sources = self.workers[index].serve(records, token_counts)
        own, tier = self.own[index], self.tier
        self.from_others[index] += sum(
            1 for record, source in zip(records, sources)
            if source == tier and record.sequence_hash not in own)

    def stored(self, worker: int, records: Sequence[BlockRecord]) -> None:
        """``worker`` stored ``records`` in the shared tier: the others learn them."""
        if self._learning:
            return
        self.own[worker].update(r.sequence_hash for r in records)
        if not self.shared:
            return
        self._learning = True
        try:
            for i, other in enumerate(self.workers):
                if i != worker:
                    other.planner.learn(self.tier, records)
        finally:
            self._learning = False


class _SharedStore(RegistryObserver):
    def __init__(self, fleet: _Fleet, worker: int) -> None:
        self.fleet, self.worker = fleet, worker

    def on_tier_stored(self, tier: str, records: Sequence[BlockRecord]) -> None:
        if tier == self.fleet.tier:
            self.fleet.stored(self.worker, records)


class PrefixRouter:
    """Routes by the longest prefix each worker holds in its own tiers, from the events of
    every worker's registry (``registries[i]`` is worker *i*'s) applied to one
    :class:`PrefixIndex`; load-bounded (see the module docstring)."""

    def __init__(self, registries: Sequence, shared: str) -> None:
        self.index = PrefixIndex()
        for i, registry in enumerate(registries):
            registry.add_observer(_IndexFeeder(self.index, i, shared))

    def choose(self, records: Sequence[BlockRecord], served: Sequence[int]) -> int:
        """The worker for a request of ``records``; ``served[i]``: requests worker *i* has
        taken so far."""
        matches = self.index.match([r.sequence_hash for r in records])
        bound = sum(served) / len(served) * (1 + LOAD_SLACK) + 1
        candidates = [i for i in range(len(served)) if served[i] <= bound]
        return max(candidates, key=lambda i: (max(matches.get(i, {}).values(), default=0),
                                              -served[i], -i))


class _IndexFeeder(RegistryObserver):
    """A worker's block events (its own tiers only), straight into the router's index."""

    def __init__(self, index: PrefixIndex, worker: int, shared: str) -> None:
        self.index, self.worker, self.shared = index, worker, shared
        self._next = 0

    def _id(self) -> int:
        self._next += 1
        return self._next

    def on_tier_stored(self, tier: str, records: Sequence[BlockRecord]) -> None:
        if tier == self.shared:
            return
        for r in records:
            self.index.apply_event(self.worker, StoredEvent(
                self._id(), tier, r.parent_hash, r.block_size,
                (StoredBlock(r.sequence_hash, r.local_hash),)))

    def on_tier_removed(self, tier: str, sequence_hashes: Sequence[int]) -> None:
        if tier != self.shared and sequence_hashes:
            self.index.apply_event(self.worker, RemovedEvent(self._id(), tier,
                                                             tuple(sequence_hashes)))

    def on_tier_cleared(self, tier: str) -> None:   # pools clear only on request; none here
        pass
