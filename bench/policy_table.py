"""Compare eviction / admission policies on many traces: one tier, trace granularity.

For each trace and capacity, prints the prefix hit ratio of each policy beside plain LRU and
the clairvoyant bound (Belady: evict the block whose next use is farthest; it reads the
future, so it is a bound, not a policy), both computed here on the same trace, and the share
of the LRU-to-Belady gap each policy closes. The traces: the packaged conversation trace, one
trace per workload of ``bench/synth_trace.py``'s ``PROFILES`` (different statistics: chat,
agents, retrieval, scans...), and any Mooncake-format file given with ``--trace``.

Example: ``python bench/policy_table.py --trace other.jsonl --capacities 5000,10000``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvstrata.config import KvConfig, TierConfig
from kvstrata.replay import TraceRequest, load_trace, parse_request, replay

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synth_trace import PROFILES, generate  # noqa: E402  (a sibling script)

DEFAULT_POLICIES = ("lru,default,lfu,lru+second-offer,lfu+second-offer,adaptive,adaptive+adaptive,"
                    "lru+predicted-reuse,default+predicted-reuse,adaptive+predicted-reuse")
"""Policies compared by default: ``eviction[+admission]`` (no admission named: ``always``)."""


NEVER = 1 << 62


def next_uses(requests: list[TraceRequest]) -> list[int]:
    """For each block look-up in trace order, the position of that block's next look-up
    (``NEVER`` if none): the future, which only the references below may read."""
    accesses = [h for r in requests for h in r.hash_ids]
    next_use = [0] * len(accesses)
    last: dict[int, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        next_use[i] = last.get(accesses[i], NEVER)
        last[accesses[i]] = i
    return next_use


def held_prefix(hash_ids: list[int], held) -> int:
    """How many of ``hash_ids``, from the first, ``held`` contains: a request's prefix hit."""
    count = 0
    for h in hash_ids:
        if h not in held:
            break
        count += 1
    return count


def belady_hits(requests: list[TraceRequest], capacity: int) -> int:
    """Prefix hits of the clairvoyant policy (touch order as the LRU reference)."""
    next_use = next_uses(requests)
    resident: dict[int, int] = {}  # id -> its next use
    heap: list[tuple[int, int]] = []  # (-next_use, id), lazy
    hits, pos = 0, 0
    for r in requests:
        hits += held_prefix(r.hash_ids, resident)
        for h in r.hash_ids:
            nu = next_use[pos]
            pos += 1
            resident[h] = nu
            heapq.heappush(heap, (-nu, h))
            while len(resident) > capacity:
                neg, victim = heapq.heappop(heap)
                if resident.get(victim) == -neg:
                    del resident[victim]
    return hits


def returning_lru_hits(requests: list[TraceRequest], capacity: int,
                       told: list[bool] | None = None) -> int:
    """Prefix hits of LRU told, at each look-up, whether the block will ever be looked up
    again (a block that will not is dropped or never stored). It knows *which* blocks return
    but not *when*: the part of Belady's lead that predicting reuse alone would win.
    With ``told`` (one flag per look-up), it is told only at the look-ups flagged."""
    next_use = next_uses(requests)
    held: OrderedDict[int, None] = OrderedDict()
    hits, pos = 0, 0
    for r in requests:
        hits += held_prefix(r.hash_ids, held)
        for h in r.hash_ids:
            returns = next_use[pos] != NEVER or (told is not None and not told[pos])
            pos += 1
            if h in held:
                if returns:
                    held.move_to_end(h)
                else:
                    del held[h]
            elif returns:
                held[h] = None
                if len(held) > capacity:
                    held.popitem(last=False)
    return hits


def policy_hits(requests: list[TraceRequest], capacity: int, policy: str) -> int:
    """Prefix hits of ``policy`` (``eviction[+admission]``) replayed by kvstrata's planner."""
    eviction, _, admission = policy.partition("+")
    config = KvConfig(tiers={"G1": TierConfig(blocks=capacity)}, eviction=eviction,
                      admission=admission or "always")
    return replay(requests, config, granularity="trace").blocks_hit


@dataclass
class Row:
    trace: str
    capacity: int
    lookups: int
    lru: int
    belady: int
    returning: int
    hits: dict[str, int]
    kinds_known: int | None = None
    """Hits of LRU told which blocks return only where the kind of block decides it (a
    synthetic trace's one-off documents and, with partial tails, last blocks)."""

    def closed(self, policy: str | None, hits: int | None = None) -> float | None:
        """Share of the LRU-to-Belady gap ``policy`` (or ``hits``) closes (None: no gap)."""
        gap = self.belady - self.lru
        hits = self.hits[policy] if hits is None else hits
        return (hits - self.lru) / gap if gap > 0 else None

    def versus_lru(self, policy: str | None, hits: int | None = None) -> str:
        """The share of the gap closed, or with no gap the points above or below LRU."""
        hits = self.hits[policy] if hits is None else hits
        closed = self.closed(policy, hits)
        if closed is not None:
            return f"{100 * closed:+.0f} %"
        return f"{100 * (hits - self.lru) / self.lookups:+.2f} points, no gap"


def synthetic_traces(requests: int, seed: int
                     ) -> tuple[dict[str, list[TraceRequest]], dict[str, list[bool]]]:
    """One trace per synthetic workload profile, reproducible from ``seed``, and for each
    the look-ups whose return the kind of block decides (:func:`dead_by_kind`)."""
    traces, decided = {}, {}
    for name, workload in PROFILES.items():
        raw = generate(requests, seed, workload)
        traces[f"synthetic {name}"] = [parse_request(json.dumps(r), f"{name}:{i + 1}")
                                       for i, r in enumerate(raw)]
        decided[f"synthetic {name}"] = dead_by_kind(raw, workload.partial_tail)
    return traces, decided


def dead_by_kind(raw: list[dict], partial_tail: bool) -> list[bool]:
    """Per look-up, whether the generator made the block's return a matter of its kind: a
    one-off document's own blocks (not the system prompt it shares), and each request's
    last block where prompts end inside it. Whether any *other* block returns (a
    conversation or agent going on) the generator draws independently of everything a
    cache can see, and each think time is memoryless."""
    out: list[bool] = []
    for r in raw:
        n, own = len(r["hash_ids"]), r["shared_prefix"]
        out += [(r["kind"] == "document" and i >= own) or (partial_tail and i == n - 1)
                for i in range(n)]
    return out


def measure(traces: dict[str, list[TraceRequest]], capacities: list[int],
            policies: list[str], decided: dict[str, list[bool]] | None = None) -> list[Row]:
    rows = []
    for name, requests in traces.items():
        lookups = sum(len(r.hash_ids) for r in requests)
        told = (decided or {}).get(name)
        for cap in capacities:
            started = time.perf_counter()
            hits = {p: policy_hits(requests, cap, p) for p in policies}
            lru = hits["lru"] if "lru" in hits else policy_hits(requests, cap, "lru")
            rows.append(Row(name, cap, lookups, lru, belady_hits(requests, cap),
                            returning_lru_hits(requests, cap), hits,
                            None if told is None else returning_lru_hits(requests, cap, told)))
            print(f"  measured {name} at C = {cap:,} in {time.perf_counter() - started:.1f} s",
                  file=sys.stderr, flush=True)
    return rows


def print_tables(rows: list[Row], policies: list[str]) -> None:
    shown = [p for p in policies if p != "lru"]
    header = ["trace", "look-ups", "LRU", *shown, "LRU knowing which documents and last blocks "
              "return", "LRU knowing which blocks return", "Belady"]
    for cap in sorted({r.capacity for r in rows}):
        print(f"\n**C = {cap:,} blocks**: prefix hit ratio, and in brackets the share of the "
              f"LRU-to-Belady gap closed\n")
        print("| " + " | ".join(header) + " |")
        print("|---|" + "---:|" * (len(header) - 1))
        for r in (r for r in rows if r.capacity == cap):
            cells = [r.trace, f"{r.lookups:,}", _ratio(r.lru, r)]
            cells += [f"{_ratio(r.hits[p], r)} ({r.versus_lru(p)})" for p in shown]
            known = ("n/a" if r.kinds_known is None else
                     f"{_ratio(r.kinds_known, r)} ({r.versus_lru(None, r.kinds_known)})")
            cells += [known, _ratio(r.returning, r), _ratio(r.belady, r)]
            print("| " + " | ".join(cells) + " |")
    gapped = [r for r in rows if r.belady > r.lru]
    if shown:
        print("\nper policy, over every trace and capacity: the worst share of the gap closed "
              "(where there is a gap), and the most points below LRU")
    for p in shown:
        worst = min(gapped, key=lambda r: r.closed(p)) if gapped else None
        lowest = min(rows, key=lambda r: (r.hits[p] - r.lru) / r.lookups)
        share = (f"{100 * worst.closed(p):+.0f} % ({worst.trace}, C = {worst.capacity:,})"
                 if worst else "no gap anywhere")
        below = 100 * max(0, lowest.lru - lowest.hits[p]) / lowest.lookups
        print(f"  {p:<22} {share}; {below:.2f} points below LRU at most"
              + (f" ({lowest.trace}, C = {lowest.capacity:,})" if below else ""))


def _ratio(hits: int, row: Row) -> str:
    return f"{100 * hits / row.lookups:.2f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", action="append", default=[],
                        help="a further Mooncake-format trace (repeatable)")
    parser.add_argument("--capacities", default="5000,10000")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help="comma-separated eviction[+admission] names")
    parser.add_argument("--requests", type=int, default=12_000,
                        help="requests per synthetic trace (0: none)")
    parser.add_argument("--seed", type=int, default=11, help="seed of the synthetic traces")
    args = parser.parse_args()
    traces = {"packaged conversation": load_trace(None)}
    for path in args.trace:
        traces[os.path.basename(path)] = load_trace(path)
    decided: dict[str, list[bool]] = {}
    if args.requests:
        synthetic, decided = synthetic_traces(args.requests, args.seed)
        traces.update(synthetic)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    rows = measure(traces, [int(c) for c in args.capacities.split(",")], policies, decided)
    print_tables(rows, policies)


if __name__ == "__main__":
    main()
