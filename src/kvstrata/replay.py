"""Replay a Mooncake-format trace through the placement planner (metadata only).

The trace and its synthetic tokens are described in :mod:`kvstrata.trace`. The replay drives
the same :class:`~kvstrata.placement.Planner` that ``KvBlockManager`` and the engine
connectors drive, with an executor that completes every copy at once and moves no bytes, so
its hit rates come from the code that places real blocks.

**Per request** (replayed one at a time, in file order), as an engine with kvstrata owning G1
would serve it:

1. **onboard**: the planner brings the longest prefix held in any tier into G1 -- blocks in
   G1 are held, the others copied from the fastest lower tier holding each (a G1 too small
   to take them all cuts the prefix short). Per tier, ``blocks_looked_up`` counts the blocks
   no faster tier served, ``blocks_hit`` those this tier served;
2. **compute** the rest, first to last: a block G1 still holds is touched (used again);
   consecutive missing blocks are one batch, filtered by G1's admission policy and registered
   in G1 in batches no larger than G1 (the engine computes them);
3. **offload**: blocks newly registered in a tier are offered to the next one down
   (write-through cascade, subject to each tier's admission filter), and so on to the bottom.

With one tier under ``lru`` this is exactly a plain LRU cache of block hashes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from .config import KvConfig
from .logical.registry import BlockRegistry, RegistryObserver
from .placement import ImmediateExecutor, Planner, drive
from .trace import (TRACE_BLOCK_TOKENS, RequestHasher, TraceFormatError, TraceRequest,
                    default_trace_path, iter_trace, load_trace, parse_request,
                    synthetic_tokens)
from .tiers import is_onboard, split_path
from .types import BlockRecord

__all__ = ["replay", "ReplayResult", "ReplayWorker", "TierStats", "hit_summary", "count_hits",
           "replay_config",
           # the trace names, re-exported for callers of the replay
           "TRACE_BLOCK_TOKENS", "RequestHasher", "TraceFormatError", "TraceRequest",
           "default_trace_path", "iter_trace", "load_trace", "parse_request",
           "synthetic_tokens"]


@dataclass
class TierStats:
    capacity: int
    eviction: str
    admission: str
    blocks_looked_up: int = 0
    blocks_hit: int = 0
    tokens_looked_up: int = 0
    tokens_hit: int = 0
    evictions: int = 0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["hit_rate"] = self.blocks_hit / self.blocks_looked_up if self.blocks_looked_up else 0.0
        d["token_hit_rate"] = self.tokens_hit / self.tokens_looked_up if self.tokens_looked_up else 0.0
        return d


def hit_summary(totals) -> dict:
    """The replay report's totals: ``requests``, ``blocks``, ``tokens``, hits and hit rates of
    anything with those counters (the metadata and the data replay share the shape)."""
    return {
        "requests": totals.requests,
        "blocks": totals.blocks,
        "tokens": totals.tokens,
        "blocks_hit": totals.blocks_hit,
        "tokens_hit": totals.tokens_hit,
        "hit_rate": totals.blocks_hit / totals.blocks if totals.blocks else 0.0,
        "token_hit_rate": totals.tokens_hit / totals.tokens if totals.tokens else 0.0,
    }


@dataclass
class ReplayResult:
    """What a replay measured; :meth:`as_dict` is the ``--json`` document."""

    trace: str
    granularity: str
    block_size: int
    requests: int = 0
    blocks: int = 0
    tokens: int = 0
    blocks_hit: int = 0
    tokens_hit: int = 0
    tiers: dict[str, TierStats] = field(default_factory=dict)
    moves: dict[str, int] = field(default_factory=dict)
    """Blocks copied per path, e.g. ``moves["G2->G1"]``."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Blocks a tier's admission filter refused, per tier."""
    wall_seconds: float = 0.0
    curve: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    registry: BlockRegistry | None = None
    planner: Planner | None = None

    @property
    def block_ops(self) -> int:
        """Block-level pool operations: one per block accessed (touched, or allocated and
        registered), one per block moved between tiers, one per eviction."""
        moved = sum(self.moves.values())
        return self.blocks + moved + sum(t.evictions for t in self.tiers.values())

    @property
    def promotions(self) -> int:
        """Blocks copied towards faster tiers (onboards)."""
        return sum(n for path, n in self.moves.items() if is_onboard(*split_path(path)))

    @property
    def demotions(self) -> int:
        """Blocks copied towards slower tiers (the write-through cascade)."""
        return sum(self.moves.values()) - self.promotions

    def as_dict(self) -> dict:
        return {
            "trace": self.trace,
            "granularity": self.granularity,
            "block_size": self.block_size,
            **hit_summary(self),
            "tiers": {name: t.as_dict() for name, t in self.tiers.items()},
            "moves": dict(sorted(self.moves.items())),
            "rejected": dict(sorted(self.rejected.items())),
            "promotions": self.promotions,
            "demotions": self.demotions,
            "wall_seconds": round(self.wall_seconds, 4),
            "block_accesses_per_s": round(self.blocks / self.wall_seconds) if self.wall_seconds else 0,
            "block_ops": self.block_ops,
            "block_ops_per_s": round(self.block_ops / self.wall_seconds) if self.wall_seconds else 0,
        }


def replay(
    requests: Iterable[TraceRequest],
    config: KvConfig,
    *,
    granularity: str = "engine",
    observers: Sequence[RegistryObserver] = (),
    trace_name: str = "<requests>",
    progress: Callable[[int], None] | None = None,
    curve_every: int = 0,
) -> ReplayResult:
    """Replay ``requests`` through a :class:`~kvstrata.placement.Planner` built from
    ``config`` (see the module docstring).

    ``observers`` are attached to the planner's registry (they see every block stored and
    removed, e.g. an event publisher). ``progress(n)`` is called after every request with
    the count done; ``curve_every`` > 0 records the cumulative hit rate (total and per tier)
    every that many requests.
    """
    hasher = RequestHasher(config.block_size, granularity)
    config = replay_config(config, hasher)
    planner = Planner(config)
    for observer in observers:
        planner.registry.add_observer(observer)
    worker = ReplayWorker(planner, config, ReplayResult(trace_name, granularity,
                                                        hasher.block_size))
    result = worker.result
    started = time.perf_counter()
    for request in requests:
        worker.serve(*hasher.records(request))
        if progress is not None:
            progress(result.requests)
        if curve_every and result.requests % curve_every == 0:
            result.curve.append((result.requests, _rates(result)))
    result.wall_seconds = time.perf_counter() - started
    worker.finish()
    if curve_every and (not result.curve or result.curve[-1][0] != result.requests):
        result.curve.append((result.requests, _rates(result)))
    return result


def replay_config(config: KvConfig, hasher: RequestHasher) -> KvConfig:
    """``config`` for a replay by ``hasher``: pools must take trace-sized blocks when the
    replay is at trace granularity."""
    if hasher.granularity == "trace":
        return replace(config, block_size=hasher.block_size)
    return config


class ReplayWorker:
    """One worker of a replay: a planner, the engine serving requests on it, and what it
    measured (``result``). The single replay has one; ``replay --workers N`` has N."""

    def __init__(self, planner: Planner, config: KvConfig, result: ReplayResult) -> None:
        self.planner = planner
        self.result = result
        result.registry, result.planner = planner.registry, planner
        for name in planner.tiers:
            result.tiers[name] = TierStats(planner.pools[name].capacity,
                                           config.tier_eviction(name),
                                           config.tier_admission(name))
        self._serve = _RequestServer(planner)

    def serve(self, records: list[BlockRecord], token_counts: Sequence[int]) -> tuple[str, ...]:
        """Serve one request; returns the tier that served each block of its prefix."""
        sources = self._serve(records)
        count_hits(self.result, sources, token_counts)
        self.result.requests += 1
        return sources

    def finish(self) -> None:
        """Copy the planner's totals (evictions, moves, refusals) into the result."""
        result, planner = self.result, self.planner
        for name, pool in planner.pools.items():
            result.tiers[name].evictions = pool.evictions
        result.moves = planner.stats.moved()
        result.rejected = planner.stats.skipped_for("admission")


def _rates(result: ReplayResult) -> dict[str, float]:
    rates = {"total": result.blocks_hit / result.blocks if result.blocks else 0.0}
    for name, t in result.tiers.items():
        rates[name] = t.blocks_hit / t.blocks_looked_up if t.blocks_looked_up else 0.0
    return rates


class _RequestServer:
    """Serves one request at a time as an engine would (see the module docstring)."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.executor = ImmediateExecutor()
        self.top = planner.pools[planner.top]

    def __call__(self, records: list[BlockRecord]) -> tuple[str, ...]:
        """Serve a request's blocks; returns the tier that served each block of its prefix."""
        planner, top = self.planner, self.top
        hashes = [r.sequence_hash for r in records]
        planner.prepare_onboard(hashes)
        drive(planner, self.executor)
        (loaded,) = planner.take_finished()
        loaded.release()
        i, n = len(loaded), len(records)
        while i < n:
            j = i + 1
            if hashes[i] in top:
                while j < n and hashes[j] in top:
                    j += 1
                top.touch(hashes[i:j])
            else:
                while j < n and hashes[j] not in top:
                    j += 1
                self._compute(records[i:j])
            i = j
        return loaded.sources

    def _compute(self, records: list[BlockRecord]) -> None:
        """Register computed blocks G1 admits, in batches G1 can hold, cascading each."""
        planner, top = self.planner, self.top
        admitted = planner.admit(planner.top, records)
        chunk = max(1, top.capacity)
        for start in range(0, len(admitted), chunk):
            part = admitted[start:start + chunk]
            blocks = top.allocate(len(part))
            blocks.apply_token_blocks(part)
            top.release(planner.register(blocks))
            drive(planner, self.executor)


def count_hits(result, sources: Sequence[str], token_counts: Sequence[int]) -> None:
    """Add one request's look-ups and hits to ``result`` (a :class:`ReplayResult` or anything
    with its counters): ``sources`` names the tier that served each block of the delivered
    prefix; per tier, blocks looked up are those no faster tier served."""
    n = len(token_counts)
    total_tokens = sum(token_counts)
    result.blocks += n
    result.tokens += total_tokens
    result.blocks_hit += len(sources)
    result.tokens_hit += sum(token_counts[: len(sources)])
    looked_up, tokens_left = n, total_tokens
    for name, stats in result.tiers.items():
        stats.blocks_looked_up += looked_up
        stats.tokens_looked_up += tokens_left
        mine = [i for i, t in enumerate(sources) if t == name]
        stats.blocks_hit += len(mine)
        mine_tokens = sum(token_counts[i] for i in mine)
        stats.tokens_hit += mine_tokens
        looked_up -= len(mine)
        tokens_left -= mine_tokens
