"""Replay a Mooncake-format trace through the real pools of a tier hierarchy.

Trace format (REFERENCE.md §6): one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` (tokens) and ``hash_ids`` (one id per 512-token block;
requests that share leading ids share that prefix).

**Synthetic tokens.** Each trace id ``h`` stands for 512 tokens; token ``j`` (0..511) of id
``h`` is ``(h * 512 + j) mod 2**32``. A request's tokens are the concatenation of its ids'
tokens, hashed with :mod:`kvstrata.tokens` exactly as an engine's prompt would be, so the
replay exercises the same hashing and matching path as real traffic.

**Granularity.** ``trace``: one block per id (block size 512); every id is a block, including
the request's last, partially filled one, whose token count is what ``input_length`` leaves.
``engine``: blocks of ``block_size`` tokens (e.g. 16, 32 per id); only the prompt's full
blocks count (``min(input_length, 512 * ids) // block_size``), as an engine would hash them.

**Per request** (requests are replayed one at a time, in file order):

1. the longest prefix held anywhere is located, the fastest tier holding each block serving it;
   per tier, ``blocks_looked_up`` counts blocks that no faster tier served and ``blocks_hit``
   those this tier served;
2. then each block, first to last, is touched in G1 if G1 holds it, onboarded into G1 if it
   belongs to the located prefix and a lower tier still holds it, and computed (allocated and
   registered in G1) otherwise; consecutive blocks of one kind are one batch;
3. blocks newly registered in G1 are offloaded down the hierarchy (write-through cascade,
   subject to each lower tier's admission filter).

With one tier under ``lru`` this is exactly the plain LRU of REFERENCE.md §6.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from .config import KvConfig
from .logical.hierarchy import TierHierarchy
from .logical.registry import BlockRecord, BlockRegistry, RegistryObserver
from .tokens import DEFAULT_SEED, hash_blocks

TRACE_BLOCK_TOKENS = 512
"""Tokens behind one Mooncake trace id."""


class TraceFormatError(ValueError):
    """A malformed trace line; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def default_trace_path() -> Path:
    """The Mooncake conversation trace shipped inside the package."""
    return Path(str(resources.files("kvstrata") / "data" / "conversation_trace.jsonl.gz"))


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def parse_request(line: str, where: str) -> TraceRequest:
    """One trace line -> :class:`TraceRequest`; ``where`` ("file:line") names it in errors."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("input_length", "hash_ids") if k not in obj]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**32 // TRACE_BLOCK_TOKENS
        for i in ids
    ):
        raise TraceFormatError(
            f"{where}: hash_ids must be a list of integers in [0, {2**32 // TRACE_BLOCK_TOKENS})"
        )
    fields = {}
    for key in ("timestamp", "input_length", "output_length"):
        value = obj.get(key, 0)
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
            or value < 0
        ):
            raise TraceFormatError(f"{where}: {key} must be a non-negative number, got {value!r}")
        fields[key] = int(value)
    return TraceRequest(fields["timestamp"], fields["input_length"], fields["output_length"], tuple(ids))


def iter_trace(path: str | os.PathLike[str] | None = None) -> Iterator[TraceRequest]:
    """Requests of a trace file (plain or .gz); the packaged trace when ``path`` is None."""
    path = Path(path) if path is not None else default_trace_path()
    with _open_text(path) as fh:
        for number, line in enumerate(fh, start=1):
            if line.strip():
                yield parse_request(line, f"{path}:{number}")


def load_trace(path: str | os.PathLike[str] | None = None) -> list[TraceRequest]:
    """All requests of a trace (see :func:`iter_trace`)."""
    return list(iter_trace(path))


# -- hashing a request -----------------------------------------------------------------------

def synthetic_tokens(hash_id: int) -> np.ndarray:
    """The 512 deterministic token ids standing for trace id ``hash_id``."""
    base = hash_id * TRACE_BLOCK_TOKENS
    return (np.arange(base, base + TRACE_BLOCK_TOKENS, dtype=np.uint64) & 0xFFFFFFFF).astype("<u4")


class RequestHasher:
    """Turns a trace request into the block records an engine would compute for its prompt.

    Hashes of one id's blocks depend only on (parent hash, id), so they are memoised on that
    pair when the block size divides 512 (always the case for engine block sizes 16..512).
    """

    def __init__(self, block_size: int, granularity: str, seed: int = DEFAULT_SEED) -> None:
        if granularity not in ("trace", "engine"):
            raise ValueError(f"granularity must be 'trace' or 'engine', got {granularity!r}")
        if granularity == "trace":
            block_size = TRACE_BLOCK_TOKENS
        self.block_size = block_size
        self.granularity = granularity
        self.seed = seed
        self._memo: dict[tuple[int | None, int], list[BlockRecord]] = {}
        self._aligned = TRACE_BLOCK_TOKENS % block_size == 0

    def records(self, request: TraceRequest) -> tuple[list[BlockRecord], list[int]]:
        """The request's block records and the prompt tokens each block covers."""
        ids = request.hash_ids
        bs = self.block_size
        if self.granularity == "trace":
            n_blocks = len(ids)
        else:
            n_blocks = min(request.input_length, len(ids) * TRACE_BLOCK_TOKENS) // bs
        if self._aligned:
            records = self._aligned_records(ids, n_blocks)
        else:
            tokens = np.concatenate([synthetic_tokens(h) for h in ids]) if ids else np.zeros(0, "<u4")
            local, seqs = hash_blocks(tokens[: n_blocks * bs], bs, self.seed)
            parents = [None, *seqs[:-1]]
            records = [BlockRecord(s, l, p, bs) for s, l, p in zip(seqs, local, parents)]
        token_counts = [bs] * len(records)
        if self.granularity == "trace" and records:
            last = request.input_length - TRACE_BLOCK_TOKENS * (len(records) - 1)
            token_counts[-1] = max(0, min(TRACE_BLOCK_TOKENS, last))
        return records, token_counts

    def _aligned_records(self, ids: Sequence[int], n_blocks: int) -> list[BlockRecord]:
        per_id = TRACE_BLOCK_TOKENS // self.block_size
        out: list[BlockRecord] = []
        parent: int | None = None
        memo = self._memo
        for h in ids:
            if len(out) >= n_blocks:
                break
            key = (parent, h)
            recs = memo.get(key)
            if recs is None:
                local, seqs = hash_blocks(synthetic_tokens(h), self.block_size, self.seed, parent)
                parents = [parent, *seqs[:-1]]
                recs = [BlockRecord(s, l, p, self.block_size) for s, l, p in zip(seqs, local, parents)]
                memo[key] = recs
            out.extend(recs[: n_blocks - len(out)] if len(out) + per_id > n_blocks else recs)
            parent = out[-1].sequence_hash
        return out


# -- the replay ------------------------------------------------------------------------------

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
    wall_seconds: float = 0.0
    curve: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    registry: BlockRegistry | None = None
    hierarchy: TierHierarchy | None = None

    @property
    def block_ops(self) -> int:
        """Block-level pool operations: one per block accessed (touched, or allocated and
        registered), one per block moved between tiers, one per eviction."""
        moved = sum(n for path, n in self.moves.items() if "->" in path)
        return self.blocks + moved + sum(t.evictions for t in self.tiers.values())

    @property
    def promotions(self) -> int:
        return sum(n for path, n in self.moves.items() if path.endswith("->G1"))

    @property
    def demotions(self) -> int:
        return sum(
            n for path, n in self.moves.items() if "->" in path and not path.endswith("->G1")
        )

    def as_dict(self) -> dict:
        return {
            "trace": self.trace,
            "granularity": self.granularity,
            "block_size": self.block_size,
            **hit_summary(self),
            "tiers": {name: t.as_dict() for name, t in self.tiers.items()},
            "moves": {k: v for k, v in sorted(self.moves.items()) if "->" in k},
            "rejected": {k.split(":", 1)[1]: v for k, v in sorted(self.moves.items())
                         if k.startswith("rejected:")},
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
    """Replay ``requests`` through a :class:`TierHierarchy` built from ``config``.

    ``progress(n)`` is called after every request with the count done; ``curve_every`` > 0
    records the cumulative hit rate (total and per tier) every that many requests.
    """
    hasher = RequestHasher(config.block_size, granularity)
    if granularity == "trace":
        # Pools must accept trace-sized blocks: their block size is the hasher's.
        from dataclasses import replace

        config = replace(config, block_size=hasher.block_size)
    hierarchy = TierHierarchy(config)
    for observer in observers:
        hierarchy.registry.add_observer(observer)
    result = ReplayResult(trace_name, granularity, hasher.block_size, registry=hierarchy.registry,
                          hierarchy=hierarchy)
    for name in hierarchy.tier_names:
        result.tiers[name] = TierStats(
            hierarchy.pools[name].capacity, config.tier_eviction(name), config.tier_admission(name)
        )
    started = time.perf_counter()
    for request in requests:
        records, token_counts = hasher.records(request)
        _replay_request(hierarchy, records, token_counts, result)
        result.requests += 1
        if progress is not None:
            progress(result.requests)
        if curve_every and result.requests % curve_every == 0:
            result.curve.append((result.requests, _rates(result)))
    result.wall_seconds = time.perf_counter() - started
    for name, pool in hierarchy.pools.items():
        result.tiers[name].evictions = pool.evictions
    result.moves = {k: v for k, v in hierarchy.moves.items() if v}
    if curve_every and (not result.curve or result.curve[-1][0] != result.requests):
        result.curve.append((result.requests, _rates(result)))
    return result


def _rates(result: ReplayResult) -> dict[str, float]:
    rates = {"total": result.blocks_hit / result.blocks if result.blocks else 0.0}
    for name, t in result.tiers.items():
        rates[name] = t.blocks_hit / t.blocks_looked_up if t.blocks_looked_up else 0.0
    return rates


def _replay_request(
    hierarchy: TierHierarchy,
    records: list[BlockRecord],
    token_counts: list[int],
    result: ReplayResult,
) -> None:
    hashes = [r.sequence_hash for r in records]
    where = hierarchy.locate_prefix(hashes)
    hierarchy.observe_request(hashes)
    n = len(records)
    holds = _PrefixHolds(hierarchy, hashes, where) if _needs_holds(hierarchy, where, n) else None

    top_name = hierarchy.tier_names[0]
    top = hierarchy.pools[top_name]
    pools = hierarchy.pools
    served = 0  # leading prefix positions actually served (touched in G1 or onboarded)
    broken = False  # a located block had to be recomputed: the served prefix ends there
    i = 0
    while i < n:
        h = hashes[i]
        if h in top:
            j = i + 1
            while j < n and hashes[j] in top:
                j += 1
            top.touch(hashes[i:j])
        elif i < len(where) and where[i] != top_name and h in pools[where[i]]:
            source = where[i]
            j = i + 1
            while j < len(where) and where[j] == source and hashes[j] not in top and hashes[j] in pools[source]:
                j += 1
            new = hierarchy.onboard(source, records[i:j])
            hierarchy.offload(top_name, new)
        else:
            j = i + 1
            while j < n and hashes[j] not in top and not (
                j < len(where) and where[j] != top_name and hashes[j] in pools[where[j]]
            ):
                j += 1
            new = hierarchy.store_computed(records[i:j])
            hierarchy.offload(top_name, new)
            broken = broken or i < len(where)
        if not broken and served == i:
            served = min(j, len(where))
        if holds is not None:
            holds.release_through(j)
        i = j
    if holds is not None:
        holds.release_through(n)
    _count_hits(result, hierarchy.tier_names, where[:served], token_counts)


def _needs_holds(hierarchy: TierHierarchy, where: list[str], n: int) -> bool:
    """Whether to pin the located prefix while the request is served.

    With one tier nothing is brought up, and pinning would change the exact LRU touch
    order, so nothing is pinned. With lower tiers, bringing blocks up (and the write-through
    behind it) could evict a later prefix block before its turn; an engine pins the prefix
    it scheduled, and so does the replay. (Hits are counted as what was actually served
    either way: a located block that had to be recomputed ends the served prefix.)
    """
    return len(hierarchy.tier_names) > 1 and bool(where)


class _PrefixHolds:
    """Handles pinning the located prefix, per tier, released as the replay passes them.

    A tier smaller than the request is not pinned (the request could not fit beside its
    pins); its blocks may then be evicted before their turn and are recomputed.
    """

    def __init__(self, hierarchy: TierHierarchy, hashes: list[int], where: list[str]) -> None:
        self._runs: list[tuple[int, object]] = []  # (end position, handle), by position
        n = len(hashes)
        start = 0
        while start < len(where):
            end = start + 1
            while end < len(where) and where[end] == where[start]:
                end += 1
            pool = hierarchy.pools[where[start]]
            if n <= pool.capacity:
                self._runs.append((end, pool.acquire(hashes[start:end])))
            start = end
        self._next = 0

    def release_through(self, position: int) -> None:
        """Release the holds of every run that ends at or before ``position``."""
        runs = self._runs
        while self._next < len(runs) and runs[self._next][0] <= position:
            runs[self._next][1].release()  # type: ignore[attr-defined]
            self._next += 1


def _count_hits(result: ReplayResult, tier_names: list[str], served: list[str],
                token_counts: list[int]) -> None:
    """Add one request's look-ups and hits: per tier, what no faster tier served."""
    n = len(token_counts)
    total_tokens = sum(token_counts)
    result.blocks += n
    result.tokens += total_tokens
    result.blocks_hit += len(served)
    result.tokens_hit += sum(token_counts[: len(served)])
    looked_up, tokens_left = n, total_tokens
    for name in tier_names:
        stats = result.tiers[name]
        stats.blocks_looked_up += looked_up
        stats.tokens_looked_up += tokens_left
        mine = [i for i, t in enumerate(served) if t == name]
        stats.blocks_hit += len(mine)
        mine_tokens = sum(token_counts[i] for i in mine)
        stats.tokens_hit += mine_tokens
        looked_up -= len(mine)
        tokens_left -= mine_tokens
