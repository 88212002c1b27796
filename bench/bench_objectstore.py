"""G4 object store: ObjectStorage put/get vs a bare obstore loop, against a local SeaweedFS.

Starts its own SeaweedFS (``weed mini``, signed S3, loopback) and, for each block size, moves
the same number of blocks both ways with the same concurrency:

* ours: :meth:`ObjectStorage.write_blocks` (header + xxh3-64 of every block, conditional PUT
  ``If-None-Match: *``) and :meth:`ObjectStorage.read_blocks` (header, fingerprint, geometry,
  sequence hash and xxh3-64 verified, payload copied into a destination array);
* baseline: a ``ThreadPoolExecutor`` of the same size running plain ``obstore.put`` of
  prebuilt bodies of the same length and ``obstore.get(...).bytes()`` of the same objects
  (each reply dropped at once, so its memory is reused), nothing else.

Every figure is the best of ``--reps`` runs, ours and the baseline interleaved run by run;
GB/s counts payload bytes. The server shares the machine's cores with the client, so PUTs are
bound by the server. Goal: ours >= 80 % of the bare loop. Prints ratios, never asserts timing.
``--protect keyed`` (what a G4 tier does: every object tagged with a key from the deployment's
secret) or ``--protect encrypted`` (``encrypt_at_rest``: AES-256-GCM) measures ours so.
Usage: ``python bench/bench_objectstore.py [--quick] [--reps N] [--concurrency N]
[--protect none|keyed|encrypted]``.

Measured on this 2-core machine (SeaweedFS 4.48, obstore 0.12.1, 256 blocks, 16 in flight,
best of 3), payload GB/s ours / bare (ratio)::

    256 KiB  put 0.101 / 0.098 (1.03)   get 0.324 / 0.331 (0.98)
    2 MiB    put 0.171 / 0.181 (0.94)   get 0.931 / 0.833 (1.12)

Run to run the ratios move by about +-0.1 (the server shares the two cores).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import obstore

from kvstrata.physical import LayoutConfig, ObjectStorage
from kvstrata.physical.storage.object_format import HEADER_SIZE
from kvstrata.physical.storage.seaweed import SeaweedServer

GOAL = 0.80


def geometry(block_kib: int) -> LayoutConfig:
    """32 layers of K/V, bf16, 16 tokens; inner_dim sized for ``block_kib`` KiB blocks."""
    inner = block_kib * 1024 // (32 * 2 * 16 * 2)
    return LayoutConfig(num_blocks=1, num_layers=32, outer_dim=2, page_size=16,
                        inner_dim=inner, dtype="bf16")


def _protection(name: str) -> dict:
    """ObjectStorage's keyword arguments for ``--protect`` (a random deployment secret)."""
    import os

    from kvstrata.physical.tags import BlockCipher, BlockTagger

    if name == "none":
        return {}
    secret = os.urandom(32)
    kw = {"tagger": BlockTagger.from_secret(secret)}
    if name == "encrypted":
        kw.update(cipher=BlockCipher.from_secret(secret), encrypt=True)
    return kw


def run_size(server: SeaweedServer, block_kib: int, blocks: int, reps: int,
             concurrency: int, protect: str = "none") -> dict[str, float]:
    cfg = geometry(block_kib)
    bb = cfg.block_bytes
    rng = np.random.default_rng(block_kib)
    sources = [rng.integers(0, 256, bb, dtype=np.uint8) for _ in range(blocks)]
    dests = [np.empty(bb, np.uint8) for _ in range(blocks)]
    bodies = [rng.integers(0, 256, HEADER_SIZE + bb, dtype=np.uint8) for _ in range(blocks)]
    seqs = list(range(blocks))
    store = ObjectStorage(cfg, server.s3_config(), namespace=f"bench/{protect}/{block_kib}k",
                          fingerprint="bench", max_concurrency=concurrency,
                          **_protection(protect))
    raw = store.client.store          # the same obstore S3Store, used bare
    best = {k: float("inf") for k in ("ours_put", "bare_put", "ours_get", "bare_get")}
    with ThreadPoolExecutor(concurrency) as pool:
        for rep in range(reps + 1):                        # round 0 is warm-up
            ours_keys = [f"r{rep}-{i:012x}" for i in seqs]
            bare_keys = [f"bench/bare{block_kib}k/r{rep}/{i}" for i in seqs]
            ours_full = [store.namespace + k for k in ours_keys]
            runs = (
                ("bare_put", lambda: list(pool.map(
                    lambda i: obstore.put(raw, bare_keys[i], bodies[i], use_multipart=False),
                    seqs))),
                ("ours_put", lambda: store.write_blocks(ours_keys, sources, seqs)),
                ("bare_get", lambda: list(pool.map(
                    lambda k: len(obstore.get(raw, k).bytes()), ours_full))),
                ("ours_get", lambda: store.read_blocks(ours_keys, dests, seqs)))
            for key, fn in runs:
                start = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start
                if rep:
                    best[key] = min(best[key], elapsed)
    assert all(np.array_equal(s, d) for s, d in zip(sources, dests))
    counters = store.counters
    assert counters.failures == counters.misses == counters.puts_skipped_existing == 0
    store.close()
    return {k: blocks * bb / v / 1e9 for k, v in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short CI-sized run")
    parser.add_argument("--reps", type=int, default=None, help="runs per figure (best of)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--protect", choices=("none", "keyed", "encrypted"), default="none",
                        help="objects as a G4 tier stores them: tagged, or encrypted")
    args = parser.parse_args()
    blocks, reps = (64, 2) if args.quick else (256, 3)
    reps = args.reps or reps
    with SeaweedServer() as server:
        print(f"SeaweedFS {server.endpoint_url}; {blocks} blocks per batch, concurrency "
              f"{args.concurrency}, best of {reps}, interleaved, objects {args.protect}; "
              f"payload GB/s:")
        for block_kib in (256, 2048):
            gbs = run_size(server, block_kib, blocks, reps, args.concurrency, args.protect)
            label = f"{block_kib // 1024} MiB" if block_kib >= 1024 else f"{block_kib} KiB"
            for op in ("put", "get"):
                ours, bare = gbs[f"ours_{op}"], gbs[f"bare_{op}"]
                print(f"  {op} {label:>7}: ours {ours:.3f}  bare {bare:.3f}  "
                      f"ratio {ours / bare:.2f}")
                name = f"objectstore_{op}_{label.replace(' ', '')}" + (
                    "" if args.protect == "none" else f"_{args.protect}")
                print(f"RESULT name={name} ours={ours:.3f}GB/s baseline={bare:.3f}GB/s "
                      f"ratio={ours / bare:.2f} goal>={GOAL:.2f}")


if __name__ == "__main__":
    main()
