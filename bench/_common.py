"""Helpers shared by the benchmarks: best-of-N timing and the RESULT line format."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable


def best_of(repeats: int, fn: Callable[..., object], prepare: Callable[[], object] | None = None) -> float:
    """Fastest wall time of ``repeats`` runs of ``fn`` (noise on shared machines only adds).

    With ``prepare``, each run calls ``fn(prepare())`` and only ``fn`` is timed (e.g. building
    a fresh pool is not part of a lifecycle measurement).
    """
    best = float("inf")
    for _ in range(repeats):
        arg = prepare() if prepare is not None else None
        start = time.perf_counter()
        fn(arg) if prepare is not None else fn()
        best = min(best, time.perf_counter() - start)
    return best


def result_line(name: str, ours: float, baseline: float, unit: str, goal: str = "") -> str:
    """``RESULT name=... ours=... baseline=... ratio=...``: the line notes and CI logs quote."""
    ratio = ours / baseline if baseline else float("inf")
    extra = f" goal={goal}" if goal else ""
    return (
        f"RESULT name={name} ours={ours:,.0f}{unit} baseline={baseline:,.0f}{unit} "
        f"ratio={ratio:.2f}{extra}"
    )


def bare_lru_hits(requests, capacity: int) -> int:
    """Prefix hits of a plain LRU over trace ids (hit the longest cached prefix, then use or
    insert every id, evicting the least recently used), as a bare OrderedDict: a baseline."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for req in requests:
        for h in req.hash_ids:
            if h not in cache:
                break
            hits += 1
        for h in req.hash_ids:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits
