"""Compare eviction / admission policies on a trace: one tier, trace granularity.

Prints a Markdown table of prefix hit ratios per policy and capacity, beside plain LRU and the
clairvoyant ceiling (Belady: evict the block whose next use is farthest; it reads the future,
so it is a bound, not a policy) computed here on the same trace. Any Mooncake-format trace
works: ``python bench/policy_table.py --trace other.jsonl``.
"""

from __future__ import annotations

import argparse
import heapq
from collections import defaultdict

from kvstrata.config import KvConfig, TierConfig
from kvstrata.replay import load_trace, replay

POLICIES = [
    ("lru", "always"),
    ("default", "always"),
    ("lfu", "always"),
    ("lru", "second-offer"),
    ("lfu", "second-offer"),
    ("adaptive", "always"),
    ("adaptive", "adaptive"),
]


def belady_hits(requests, capacity: int) -> int:
    """Prefix hits of the clairvoyant policy (touch order as the LRU reference)."""
    accesses = [h for r in requests for h in r.hash_ids]
    next_use = [0] * len(accesses)
    last: dict[int, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        next_use[i] = last.get(accesses[i], 1 << 62)
        last[accesses[i]] = i
    resident: dict[int, int] = {}  # id -> its next use
    heap: list[tuple[int, int]] = []  # (-next_use, id), lazy
    hits, pos = 0, 0
    for r in requests:
        for h in r.hash_ids:
            if h not in resident:
                break
            hits += 1
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", help="Mooncake-format trace (default: the packaged one)")
    parser.add_argument("--capacities", default="1000,5000,10000,16000")
    args = parser.parse_args()
    requests = load_trace(args.trace)
    total = sum(len(r.hash_ids) for r in requests)
    caps = [int(c) for c in args.capacities.split(",")]
    rows: dict[str, dict[int, float]] = defaultdict(dict)
    for cap in caps:
        rows["clairvoyant (bound)"][cap] = belady_hits(requests, cap) / total
        for eviction, admission in POLICIES:
            cfg = KvConfig(tiers={"G1": TierConfig(blocks=cap)}, eviction=eviction, admission=admission)
            res = replay(requests, cfg, granularity="trace")
            name = eviction if admission == "always" else f"{eviction} + {admission}"
            rows[name][cap] = res.blocks_hit / res.blocks
    print(f"{len(requests):,} requests, {total:,} block look-ups, one tier, trace granularity\n")
    print("| policy | " + " | ".join(f"C = {c:,}" for c in caps) + " |")
    print("|---|" + "---:|" * len(caps))
    order = [n for n in rows if n != "clairvoyant (bound)"] + ["clairvoyant (bound)"]
    for name in order:
        print(f"| {name} | " + " | ".join(f"{100 * rows[name][c]:.2f} %" for c in caps) + " |")
    lru, best = rows["lru"], rows["clairvoyant (bound)"]
    print("\nshare of the LRU-to-clairvoyant gap closed:")
    for name in order[1:-1]:
        closed = [(rows[name][c] - lru[c]) / (best[c] - lru[c]) if best[c] > lru[c] else 0.0 for c in caps]
        print(f"  {name:<22} " + "  ".join(f"C={c:,}: {100 * x:+.0f} %" for c, x in zip(caps, closed)))


if __name__ == "__main__":
    main()
