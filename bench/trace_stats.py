"""Reuse statistics of a Mooncake-format trace: why caching it is hard.

Prints how many blocks are used once, the chance that a block is used again after its n-th
use, the distribution of reuse gaps (in seconds and in block look-ups), and how many
conversations (requests chained by a shared second block) have more than one turn.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from statistics import median

from kvstrata.replay import load_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", help="default: the packaged conversation trace")
    args = parser.parse_args()
    requests = load_trace(args.trace)
    uses: Counter[int] = Counter()
    last_seen: dict[int, tuple[int, int]] = {}
    gaps_s: list[float] = []
    gaps_lookups: list[int] = []
    reused_after: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # n -> [seen n times, reused]
    position = 0
    for req in requests:
        for h in req.hash_ids:
            if h in last_seen:
                t, p = last_seen[h]
                gaps_s.append((req.timestamp - t) / 1000)
                gaps_lookups.append(position - p)
                reused_after[uses[h]][1] += 1
            uses[h] += 1
            reused_after[uses[h]][0] += 1
            last_seen[h] = (req.timestamp, position)
            position += 1
    once = sum(1 for n in uses.values() if n == 1)
    print(f"{len(requests):,} requests, {position:,} block look-ups, {len(uses):,} distinct blocks")
    print(f"used once: {once:,} ({100 * once / len(uses):.1f} % of distinct blocks)")
    for n in range(1, 6):
        seen, again = reused_after[n]
        if seen:
            print(f"  after its use #{n}: used again {100 * again / seen:.0f} % of the time ({seen:,} blocks)")
    if gaps_s:
        gs, gl = sorted(gaps_s), sorted(gaps_lookups)
        print(f"reuse gap: median {median(gs):.0f} s / {median(gl):,.0f} look-ups; "
              f"10th percentile {gs[len(gs) // 10]:.0f} s / {gl[len(gl) // 10]:,} look-ups")
    turns: Counter[int] = Counter(r.hash_ids[1] for r in requests if len(r.hash_ids) > 1)
    multi = sum(1 for n in turns.values() if n > 1)
    print(f"conversations (by second block): {len(turns):,}, of which {multi:,} have more than one turn")


if __name__ == "__main__":
    main()
