"""Control overhead per block of the TransferEngine (goal <= 5 us per block in a batch).

A plan of N tiny blocks (1 KiB: 2 layers, K/V, 16 tokens x 8 fp16) goes G1 -> G2 and back.
Overhead per block = (time of building the plan and running it through the engine - time of a
raw contiguous ``copy_`` of the same bytes) / N: plan validation, queue hand-off, address
computation, copy kernel calls, checksum bookkeeping, result building. Measured for the
three G1 layouts and for both host checksum modes (``deferred``, the default, and ``eager``,
where the figure also includes hashing every block written into G2). Best of ``--reps`` on
both sides, interleaved run by run. Prints figures, never asserts timing.
Usage: ``python bench/bench_transfer_overhead.py [--quick] [--reps N]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvstrata.physical import (DeviceStorage, HostStorage, LayoutConfig, TransferEngine,
                               TransferPlan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short CI-sized run")
    parser.add_argument("--reps", type=int, default=None, help="runs per figure (best of)")
    args = parser.parse_args()
    n, reps = (1024, 5) if args.quick else (4096, 15)
    reps = args.reps or reps
    cfg = LayoutConfig(num_blocks=2 * n, num_layers=2, outer_dim=2, page_size=16, inner_dim=8,
                       dtype="fp16")
    raw_src = torch.randint(0, 256, (n * cfg.block_bytes,), dtype=torch.uint8)
    raw_dst = torch.empty_like(raw_src)
    rng = random.Random(0)
    print(f"{n} blocks of {cfg.block_bytes} B per plan, {reps} reps (best of)")
    lines = []
    for mode, kv_layout in [(m, k) for m in ("deferred", "eager")
                            for k in ("fully_contiguous", "block_contiguous", "outer_contiguous")]:
        g1 = DeviceStorage.allocate(cfg, kv_layout=kv_layout, device="cpu")
        try:
            g2 = HostStorage(cfg, checksums=mode)
        except TypeError:       # kvstrata before checksum modes (always eager): one mode
            if mode == "eager":
                continue
            g2 = HostStorage(cfg)
        times = {"raw": [], "G1->G2": [], "G2->G1": []}
        with TransferEngine({"G1": g1, "G2": g2}) as engine:
            for rep in range(reps + 1):
                src = rng.sample(range(2 * n), n)
                mid = rng.sample(range(2 * n), n)
                seq = list(range(n))
                for key, fn in (("raw", lambda: raw_dst.copy_(raw_src)),
                                ("G1->G2", lambda: engine.submit(
                                    TransferPlan.for_path("G1->G2", src, mid, seq, job_id=0)).result()),
                                ("G2->G1", lambda: engine.submit(
                                    TransferPlan.for_path("G2->G1", mid, src, seq, job_id=0)).result())):
                    start = time.perf_counter()
                    fn()
                    if rep:
                        times[key].append(time.perf_counter() - start)
        # best-of-reps on both sides: this shared 2-core VM has large scheduling noise
        raw = min(times["raw"]) / n * 1e6
        for path in ("G1->G2", "G2->G1"):
            per_block = min(times[path]) / n * 1e6
            lines.append((f"{mode} {kv_layout}", path, per_block - raw, raw, mode))
            print(f"  {mode:>8} G1 {kv_layout:>17} {path}: {per_block:6.2f} us/block total, "
                  f"overhead {per_block - raw:6.2f} us/block (raw copy {raw:.3f} us/block)")
    for mode in ("deferred", "eager"):
        sub = [x for x in lines if x[4] == mode]
        if not sub:
            continue
        print(f"  {mode}: mean {statistics.mean(x[2] for x in sub):.2f} us, worst "
              f"{max(x[2] for x in sub):.2f} us")
    default = [x for x in lines if x[4] == "deferred"]   # HostStorage's default here
    worst = max(lines, key=lambda x: x[2])
    mean = statistics.mean(x[2] for x in default)
    print(f"goal <= 5 us/block: worst case {worst[0]} {worst[1]} = {worst[2]:.2f} us")
    print(f"RESULT name=transfer_overhead_per_block ours={mean:.2f}us baseline={worst[3]:.3f}us "
          f"ratio={mean / 5.0:.2f} worst={worst[2]:.2f}us goal<=5us  (ours = mean overhead "
          f"with default host checksums; ratio = ours / 5 us goal; worst over all rows incl. "
          f"eager; baseline = raw copy/block)")


if __name__ == "__main__":
    main()
