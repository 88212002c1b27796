"""G1 stand-in <-> G2 batched copy through the TransferEngine vs a plain memcpy.

Baseline: ``torch`` ``copy_`` of one contiguous tensor holding the same number of bytes (the
best a copy of those bytes can do here). Ours: a TransferPlan of random block ids between a
vLLM-like LayerSeparate G1 (CPU tensors standing in for the GPU) and the FullyContiguous host
pool, including the xxh3-64 checksum of every block written into G2 (offload) and the
sequence-hash check on reads (onboard). Goals: >= 80 % of memcpy at 2 MiB blocks, >= 50 % at
64 KiB. Prints ratios, never asserts timing. Usage: ``python bench/bench_copy.py [--quick]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvstrata.physical import (DeviceStorage, HostStorage, LayoutConfig, MemmoveCopyEngine,
                               TransferEngine, TransferPlan)

GEOMETRIES = {   # name: (layers, page, inner); bf16, K and V
    "2MiB": (32, 16, 1024),   # Llama-3.1-8B, 16-token block
    "64KiB": (4, 16, 256),
}


def _timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(name: str, kv_layout: str, batch_bytes: int, pool_bytes: int, reps: int) -> dict:
    layers, page, inner = GEOMETRIES[name]
    cfg = LayoutConfig(num_blocks=1, num_layers=layers, outer_dim=2, page_size=page,
                       inner_dim=inner, dtype="bf16", alignment=4096)
    pool_blocks = max(2, pool_bytes // cfg.block_bytes)
    batch = max(1, min(batch_bytes // cfg.block_bytes, pool_blocks))
    g1 = DeviceStorage.allocate(cfg.with_blocks(pool_blocks), kv_layout=kv_layout, device="cpu")
    for region in g1.memory.regions:
        region.random_(0, 256)
    g2 = HostStorage(cfg.with_blocks(pool_blocks))
    rng = random.Random(0)
    nbytes = batch * cfg.block_bytes
    src_t = torch.randn(nbytes // 2).to(torch.bfloat16)   # same bytes, the KV dtype
    dst_t = torch.empty_like(src_t).zero_()
    copy_only = MemmoveCopyEngine()
    out = {"block": name, "g1": kv_layout, "batch": batch, "bytes": nbytes}
    with TransferEngine({"G1": g1, "G2": g2}, copy_engine=MemmoveCopyEngine()) as engine:
        def plan(path):
            src = rng.sample(range(pool_blocks), batch)
            dst = rng.sample(range(pool_blocks), batch)
            return TransferPlan(path, src, dst, [1000 + b for b in src])

        last = {}

        def offload():
            p = plan("G1->G2")
            last["p"] = p
            assert engine.submit(p).result().all_ok

        def onboard():
            p = last["p"]
            back = TransferPlan("G2->G1", p.dst_block_ids,
                                rng.sample(range(pool_blocks), batch), p.sequence_hashes)
            assert engine.submit(back).result().all_ok

        def raw_copy():
            src = rng.sample(range(pool_blocks), batch)
            dst = rng.sample(range(pool_blocks), batch)
            copy_only.copy(g1.memory, src, g2.memory, dst)

        for fn in (offload, onboard, raw_copy, lambda: dst_t.copy_(src_t)):
            fn()   # warm-up
        t_base, t_off, t_on, t_copy = [], [], [], []
        for _ in range(reps):   # interleaved so drift hits all figures alike
            t_base.append(_timed(lambda: dst_t.copy_(src_t), 1))
            t_off.append(_timed(offload, 1))
            t_on.append(_timed(onboard, 1))
            t_copy.append(_timed(raw_copy, 1))
    med = statistics.median
    gbs = lambda t: nbytes / t / 1e9   # noqa: E731
    out.update(base=gbs(med(t_base)), offload=gbs(med(t_off)), onboard=gbs(med(t_on)),
               copy_only=gbs(med(t_copy)))
    copy_only.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short CI-sized run")
    args = parser.parse_args()
    batch, pool, reps = ((16 << 20), (64 << 20), 5) if args.quick else ((64 << 20), (256 << 20), 9)
    print(f"torch threads={torch.get_num_threads()}  batch={batch >> 20} MiB  "
          f"pool={pool >> 20} MiB per tier  reps={reps} (median)")
    print(f"{'block':>6} {'G1 layout':>17} {'blocks':>6} {'memcpy':>8} {'offload':>8} "
          f"{'onboard':>8} {'copy-only':>9}  (GB/s; ratios vs memcpy)")
    results = []
    for name in GEOMETRIES:
        for kv_layout in ("outer_contiguous", "block_contiguous", "fully_contiguous"):
            r = bench(name, kv_layout, batch, pool, reps)
            results.append(r)
            b = r["base"]
            print(f"{name:>6} {kv_layout:>17} {r['batch']:>6} {b:8.2f} "
                  f"{r['offload']:5.2f}/{r['offload'] / b:.2f} {r['onboard']:5.2f}/"
                  f"{r['onboard'] / b:.2f} {r['copy_only']:5.2f}/{r['copy_only'] / b:.2f}")
    for r in results:
        if r["g1"] == "outer_contiguous":   # vLLM FlashAttention layout: the headline figure
            ours = 2 / (1 / r["offload"] + 1 / r["onboard"])   # offload+onboard, same bytes
            print(f"RESULT name=copy_g1_g2_{r['block']} ours={ours:.2f}GB/s "
                  f"baseline={r['base']:.2f}GB/s ratio={ours / r['base']:.2f}")


if __name__ == "__main__":
    main()
