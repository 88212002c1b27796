"""Pool hot path: an LRU replay of the shipped trace through kvstrata's ``BlockPool`` and
through vLLM's own v1 ``BlockPool`` (vllm.v1.core.block_pool), in the same process.

Both replay the same requests with trace ids as block hashes and C blocks (default 5,000;
vLLM gets C + 1 since it keeps block 0 as its null block), the way the trace replay serves a
request: the longest cached prefix is acquired and released (a use), then each run of the
rest is either touched (held blocks) or allocated, registered and released (missing ones).
For vLLM that is ``get_cached_block`` + ``touch`` + ``free_blocks`` and ``get_new_blocks`` +
``cache_full_blocks`` + ``free_blocks``, its hashes the 32-byte ``BlockHash`` bytes it uses
(made from the ids beforehand, as our records are). Both must give the hit count of a plain
LRU of block hashes (checked). kvstrata is run with every eviction policy (``adaptive`` with
the requests shown to its duel, as the planner does) and with the default admission filter
(``default+predicted-reuse``: shown each request, offered each missing block; what it
refuses is not stored); the ratio is same-run block accesses/s
of ours over vLLM's, interleaved, best of ``--repeats``. vLLM is also run its own way
(what its KVCacheManager calls: prefix touched, everything after it allocated anew and
cached, then freed; fewer look-ups, slightly different hits), and the ratio is taken
against the faster of its two figures. Goals: >= 2x for ``lru``, >= 1x
for every policy. Skips vLLM with a message when it is not installed. ``--no-native`` runs
kvstrata on its pure-Python paths.
"""

from __future__ import annotations

import argparse
import gc
import time

from _common import bare_lru_hits, result_line

from kvstrata.logical import blockops
from kvstrata.logical.policy import make_tier_policies
from kvstrata.logical.pool import BlockPool
from kvstrata.logical.registry import BlockRegistry
from kvstrata.replay import load_trace
from kvstrata.types import BlockRecord

POLICIES = ("lru", "default", "lfu", "adaptive", "default+predicted-reuse")


def kvstrata_replay(requests, records_of, capacity: int, policy: str, native: bool | None = None) -> int:
    """One replay through a kvstrata pool; returns prefix hits. ``policy`` is an eviction
    order, or ``eviction+admission``: blocks the filter refuses are computed and not kept
    (the trace replay's rule)."""
    eviction, _, admission = policy.partition("+")
    policies = make_tier_policies(eviction, admission or "always", capacity)
    pool = BlockPool("G1", capacity, 512, eviction=policies.eviction, registry=BlockRegistry())
    observe = policies.observe_request
    admit = policies.admission.admit_many if admission not in ("", "always") else None
    match, touch, allocate, register, release, held_ = (pool.match, pool.touch, pool.allocate,
                                                        pool.register, pool.release, pool.held)
    hits = 0
    for ids, records in zip(requests, records_of):
        if observe is not None:
            observe(ids)
        held = match(ids)
        i = len(held)
        release(held)
        hits += i
        n = len(ids)
        while i < n:
            # Which of the rest are held, asked again after each run (an allocation may
            # evict a block further on); the next run is the longest stretch alike.
            rest = held_(ids[i:])
            first = rest[0]
            k = rest.index(not first) if (not first) in rest else len(rest)
            j = i + k
            if first:
                touch(ids[i:j])
            else:
                chosen = records[i:j] if admit is None else [
                    r for r, yes in zip(records[i:j], admit(ids[i:j])) if yes]
                if chosen:
                    blocks = allocate(len(chosen))
                    blocks.apply_token_blocks(chosen)
                    release(register(blocks))
            i = j
    return hits


class _Req:
    """What vLLM's ``cache_full_blocks`` reads of a request: its block hashes."""

    __slots__ = ("block_hashes",)

    def __init__(self, block_hashes) -> None:
        self.block_hashes = block_hashes


def _vllm_pool(capacity: int):
    """A vLLM v1 BlockPool of ``capacity`` blocks: its get_cached_block, touch,
    get_new_blocks, cache_full_blocks and free_blocks."""
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

    pool = VllmBlockPool(capacity + 1, enable_caching=True, hash_block_size=512)
    return (pool.get_cached_block, pool.touch, pool.get_new_blocks, pool.cache_full_blocks,
            pool.free_blocks)


def _cached_prefix(get_cached, hashes, group) -> list:
    """The blocks of the longest prefix of ``hashes`` vLLM's pool holds."""
    held = []
    for h in hashes:
        got = get_cached(h, group)
        if got is None:
            break
        held.append(got[0])
    return held


def vllm_replay(requests, bytes_of, capacity: int) -> int:
    """The same replay through vLLM's v1 BlockPool; returns prefix hits."""
    get_cached, touch, get_new, cache_full, free = _vllm_pool(capacity)
    group = [0]
    hits = 0
    for hashes in bytes_of:
        n = len(hashes)
        held = _cached_prefix(get_cached, hashes, group)
        touch(held)
        free(held)
        i = len(held)
        hits += i
        while i < n:
            got = get_cached(hashes[i], group)
            j = i + 1
            if got is not None:
                run = [got[0]]
                while j < n:
                    got = get_cached(hashes[j], group)
                    if got is None:
                        break
                    run.append(got[0])
                    j += 1
                touch(run)
                free(run)
            else:
                while j < n and get_cached(hashes[j], group) is None:
                    j += 1
                blocks = get_new(j - i)
                cache_full(_Req(hashes[i:j]), blocks, 0, j - i, 512, 0)
                free(blocks)
            i = j
    return hits


def vllm_engine_replay(requests, bytes_of, capacity: int) -> int:
    """vLLM's own way (its KVCacheManager's calls): the longest cached prefix is touched,
    every block after it allocated anew and cached (a block held further on is cached twice,
    as vLLM does), then all freed in order. Fewer look-ups than the exact LRU, so its hits
    differ slightly; returns prefix hits."""
    get_cached, touch, get_new, cache_full, free = _vllm_pool(capacity)
    group = [0]
    hits = 0
    for hashes in bytes_of:
        n = len(hashes)
        held = _cached_prefix(get_cached, hashes, group)
        touch(held)
        i = len(held)
        hits += i
        blocks = held + get_new(n - i) if i < n else held
        cache_full(_Req(hashes), blocks, i, n, 512, 0)
        free(blocks)
    return hits


def have_vllm() -> str | None:
    try:
        import vllm.v1.core.block_pool  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace")
    parser.add_argument("--capacity", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--quick", action="store_true", help="first 3,000 requests, 2 repeats")
    parser.add_argument("--no-native", action="store_true",
                        help="kvstrata on its pure-Python paths (the fallback without a compiler)")
    args = parser.parse_args()
    if args.no_native:
        blockops.use_native(False)
    print(f"kvstrata's native block loops: {'on' if blockops.NATIVE and not args.no_native else 'off'}")
    reqs = load_trace(args.trace)
    if args.quick:
        reqs = reqs[:3_000]
        args.repeats = min(args.repeats, 2)
    requests = [list(r.hash_ids) for r in reqs]
    records_of = [[BlockRecord(h, h, p, 512) for h, p in zip(ids, [None, *ids[:-1]])]
                  for ids in requests]
    bytes_of = [[h.to_bytes(32, "little") for h in ids] for ids in requests]
    accesses = sum(map(len, requests))
    expected = bare_lru_hits(reqs, args.capacity)
    policies = args.policies.split(",")
    missing = have_vllm()
    if missing:
        print(f"vLLM not importable ({missing}): baseline skipped, kvstrata figures only")
    runs = ([("vllm", lambda: vllm_replay(requests, bytes_of, args.capacity)),
             ("vllm-engine", lambda: vllm_engine_replay(requests, bytes_of, args.capacity))]
            if not missing else [])
    runs += [(p, (lambda p=p: kvstrata_replay(requests, records_of, args.capacity, p)))
             for p in policies]
    best = {name: float("inf") for name, _ in runs}
    hits = {}
    for _ in range(args.repeats):                 # interleaved: noise hits every side alike
        for name, fn in runs:
            # The inputs (records, byte hashes: ~600K objects) are frozen out of the cyclic
            # GC's sight, for both sides; what a pool makes during the run is not.
            gc.collect()
            gc.freeze()
            start = time.perf_counter()
            hits[name] = fn()
            best[name] = min(best[name], time.perf_counter() - start)
            gc.unfreeze()
    if "vllm" in hits:
        assert hits["vllm"] == expected, f"vLLM replay {hits['vllm']} != plain LRU {expected}"
    if "lru" in hits:
        assert hits["lru"] == expected, f"kvstrata lru replay {hits['lru']} != plain LRU {expected}"
    print(f"{len(requests):,} requests, {accesses:,} block accesses, C = {args.capacity:,}, "
          f"best of {args.repeats} interleaved (plain LRU hits {expected:,})")
    base = accesses / min(best["vllm"], best["vllm-engine"]) if "vllm" in best else 0.0
    if base:
        print(f"  vLLM 0.32 v1 BlockPool, exact LRU {accesses / best['vllm'] / 1e6:8.3f} M "
              f"accesses/s  hits {hits['vllm']:,}")
        print(f"  vLLM 0.32 v1 BlockPool, its way   {accesses / best['vllm-engine'] / 1e6:8.3f} M "
              f"accesses/s  hits {hits['vllm-engine']:,} (prefix only; the rest allocated anew)")
        print(f"  (ratios below are against the faster vLLM figure, {base / 1e6:.3f} M)")
    for p in policies:
        rate = accesses / best[p]
        ratio = f"{rate / base:5.2f}x vLLM" if base else ""
        print(f"  kvstrata BlockPool ({p:<23}) {rate / 1e6:8.3f} M accesses/s  hits "
              f"{hits[p]:,}  {ratio}")
    for p in policies:
        if base:
            goal = ">=2x" if p == "lru" else ">=1x"
            print(result_line(f"pool_replay_{p}_vs_vllm", accesses / best[p], base,
                              " accesses/s", goal))


if __name__ == "__main__":
    main()
