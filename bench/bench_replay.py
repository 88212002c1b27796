"""Replay throughput: block accesses/s through the real pools, vs a bare OrderedDict LRU.

Both replay the same trace with one LRU tier at trace granularity and must agree on the hit
count (checked); the bare simulation does nothing else (no hashing of synthetic tokens, no
handles, registry or events), so the ratio is the price of the real machinery per block.
Also prints the three-tier default run and the engine-granularity run for reference.
"""

from __future__ import annotations

import argparse
import time

from _common import bare_lru_hits, best_of, result_line

from kvstrata.config import KvConfig, TierConfig, load_config
from kvstrata.replay import load_trace, replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace")
    parser.add_argument("--capacity", type=int, default=5_000)
    parser.add_argument("--quick", action="store_true", help="first 3,000 requests only")
    args = parser.parse_args()
    requests = load_trace(args.trace)
    if args.quick:
        requests = requests[:3_000]
    blocks = sum(len(r.hash_ids) for r in requests)
    # admission "always": a lone tier is the bottom one, whose default admission filter
    # (predicted reuse) would make it no plain LRU
    config = KvConfig(tiers={"G1": TierConfig(blocks=args.capacity, admission="always")},
                      eviction="lru")
    repeats = 1 if args.quick else 3
    holder = {}
    t_ours = best_of(repeats, lambda: holder.__setitem__("r", replay(requests, config, granularity="trace")))
    t_bare = best_of(repeats, lambda: holder.__setitem__("b", bare_lru_hits(requests, args.capacity)))
    assert holder["r"].blocks_hit == holder["b"], "replay and bare LRU disagree"
    print(f"{len(requests):,} requests, {blocks:,} block accesses, one LRU tier of {args.capacity:,}")
    print(f"  kvstrata replay (hash + pools)    {blocks / t_ours:>12,.0f} block accesses/s")
    print(f"  bare OrderedDict LRU              {blocks / t_bare:>12,.0f} block accesses/s")
    start = time.perf_counter()
    three = replay(requests, load_config(env={}), granularity="trace")
    t3 = time.perf_counter() - start
    print(f"  default G1/G2/G3, trace blocks    {three.blocks / t3:>12,.0f} block accesses/s")
    sub = requests[:1_000]
    start = time.perf_counter()
    eng = replay(sub, load_config(env={}), granularity="engine")
    te = time.perf_counter() - start
    print(f"  default G1/G2/G3, 16-token blocks {eng.blocks / te:>12,.0f} block accesses/s "
          f"(first {len(sub):,} requests)")
    print(result_line("replay_lru", blocks / t_ours, blocks / t_bare, " accesses/s"))


if __name__ == "__main__":
    main()
