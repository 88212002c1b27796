"""Control overhead per block of the TransferEngine (goal <= 5 us per block in a batch).

A plan of N tiny blocks (1 KiB: 2 layers, K/V, 16 tokens x 8 fp16) goes G1 -> G2 and back.
Overhead per block = (time of building the plan and running it through the engine - time of a
raw contiguous ``copy_`` of the same bytes) / N: plan validation, queue hand-off, address
computation, copy kernel calls, checksum bookkeeping, result building. Measured for the
three G1 layouts and for both host checksum modes (``deferred``, the default, and ``eager``,
where the figure also includes hashing every block written into G2). Best of ``--reps`` on
both sides, interleaved run by run.

Then the **host work of a GPU plan** (what a G1 <-> G2 plan on a GPU costs the host: checking,
invalidating and sealing the G2 slots, comparing device checksums, building the result, the
hand-off to the engine's thread; the part before the first launch and after the last slice
is not hidden by the copy). The GPU copy engine is stood in for by :class:`GpuStandIn`,
which does no work (a GPU leaves the host none) but hands on each slice with a checksum per
block, as the GPU engine does; the same plans as above, into and out of a G2 that verifies
reads (the connector's default), go through the engine's device-checksum paths. Host work =
a plan's wall time, submitted and awaited, / N.
Prints figures, never asserts timing.
Usage: ``python bench/bench_transfer_overhead.py [--quick] [--reps N]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import numpy as np

from kvstrata.physical import (DeviceStorage, HostStorage, LayoutConfig, MemmoveCopyEngine,
                               TransferEngine, TransferPlan)
from kvstrata.physical.copy import OFFLOAD
from kvstrata.physical.device_copy import slice_bounds


class GpuStandIn(MemmoveCopyEngine):
    """Stands in for the GPU copy engine's device-checksum path with no work of its own, as
    a GPU leaves the host none: it moves no bytes and hands on each slice (32 MiB, as
    :meth:`DeviceCopyEngine.copy_summed` slices) with a checksum per block made from its G2
    slot, so an onboard finds the checksum the offload of that slot recorded."""

    slice_bytes = 32 << 20

    def summable(self, src, dst) -> bool:
        return True

    def copy_summed(self, src, src_ids, dst, dst_ids, *, direction=OFFLOAD, landed=None):
        g2_ids = np.asarray(dst_ids if direction == OFFLOAD else src_ids, dtype=np.int64)
        sums = g2_ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(1)
        for lo, hi in slice_bounds(len(g2_ids), src.layout.config.block_bytes,
                                   self.slice_bytes):
            if landed is not None:
                landed(lo, hi, sums[lo:hi])
        return sums


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
    gpu_path(cfg, n, reps, rng)


def gpu_path(cfg: LayoutConfig, n: int, reps: int, rng: random.Random) -> None:
    """The host work of a verified G1 <-> G2 plan on the device-checksum path (see the
    module docstring), per G1 layout: a plan's wall time, submitted and awaited, with
    :class:`GpuStandIn` as the copy engine. Every slice's seal counts, though on a GPU all
    but the last one's overlap the copy."""
    print(f"host work of a GPU plan (device-checksum path, {GpuStandIn.__name__} standing "
          f"in for the GPU), {n} blocks:")
    rows = []
    for kv_layout in ("fully_contiguous", "block_contiguous", "outer_contiguous"):
        g1 = DeviceStorage.allocate(cfg, kv_layout=kv_layout, device="cpu")
        g2 = HostStorage(cfg, verify_reads=True)
        stand_in = GpuStandIn()
        work: dict[str, list[float]] = {"G1->G2": [], "G2->G1": []}
        with TransferEngine({"G1": g1, "G2": g2}, copy_engine=stand_in) as engine:
            for rep in range(reps + 1):
                src = rng.sample(range(2 * n), n)
                mid = rng.sample(range(2 * n), n)
                seq = [rng.getrandbits(64) for _ in range(n)]
                for plan in (TransferPlan.for_path("G1->G2", src, mid, seq, job_id=0),
                             TransferPlan.for_path("G2->G1", mid, src, seq, job_id=0)):
                    start = time.perf_counter()
                    out = engine.submit(plan).result()
                    elapsed = time.perf_counter() - start
                    # every block moved, checked on the way
                    assert out.all_ok, (kv_layout, plan.path, out.failures[:1], out.error)
                    if rep:
                        work[plan.path].append(elapsed)
        g2.close()
        for path, seconds in work.items():
            per_block = min(seconds) / n * 1e6
            rows.append(per_block)
            print(f"  G1 {kv_layout:>17} {path}: host work {per_block:6.3f} us/block, "
                  f"{min(seconds) * 1e3:.3f} ms a plan")
    print(f"RESULT name=gpu_plan_host_work_per_block ours={statistics.mean(rows):.3f}us "
          f"worst={max(rows):.3f}us  (mean over layouts and directions; the stand-in does "
          f"no work, as a GPU leaves the host none)")


if __name__ == "__main__":
    main()
