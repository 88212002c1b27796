"""G1 (CUDA) <-> G2 (host memory registered with CUDA) on a GPU, against the DMA limit.

For each geometry (2 MiB and 64 KiB blocks) and each KV layout vLLM hands a connector
(FlashAttention ``[2, blocks, ...]``, FlashInfer ``[blocks, 2, ...]``, MLA ``[blocks, page,
dim]``, one tensor per layer), a batch of ``--batch-mib`` of randomly scattered blocks on both
sides, best of ``--reps``, all in one run:

* **DMA limit**: one contiguous copy of the batch's bytes between device memory and the same
  kind of host memory G2 uses (page-aligned, registered with CUDA), each direction;
* **naive reference**: per layer ``index_select`` of the blocks into one packed device buffer,
  then one DMA into host memory (offload); one DMA then per-layer ``index_copy_`` (onboard);
* **kvstrata**: TransferEngine plans G1->G2 and G2->G1 with integrity on (G2 verifies reads:
  every block offloaded gets its device checksum computed on the GPU, every block onboarded is
  checked against it), for each transport (kernel: the Triton copy kernel through host
  memory; staged: the kernel packs blocks in device memory, DMA moves each run of host
  slots; auto, the default: staged for slices of long host runs, else kernel; dma: one
  ``cuMemcpyBatchAsync`` copy per piece with a checksum kernel in device memory), each
  transport's copy alone, and the same plans verified on the host instead (xxh3 on host
  threads);
* **overlap**: a forward-sized run of bf16 matrix products on the default stream alone, an
  onboard alone, and both at once: both together should take about max(), not sum();
* **G3 -> G1**: blocks read from a slab file (O_DIRECT where the filesystem allows) through
  the engine's registered bounce buffer into G1, against a raw ``preadv`` of the same blocks;
* host hashing rates, and with ``--sweep`` the transports alone at other launch shapes.

Bytes are checked once per layout outside the timing. Prints a table (ratios to the DMA
limit) and, with ``--json PATH``, writes every figure. Needs CUDA; exits 2 without it.
Usage: ``python bench/bench_gpu_copy.py [--quick] [--reps N] [--batch-mib M] [--json PATH]
[--sweep] [--transports auto,kernel,staged,dma,host]`` (``scripts/gpu-check`` runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

from kvstrata.physical import (DeviceStorage, DiskStorage, HostStorage, TransferEngine,
                               TransferPlan)
from kvstrata.physical.buffers import AlignedBuffer
from kvstrata.physical.device_copy import DeviceCopyEngine

GEOMETRIES = {   # name: (layers, page, kv heads, head dim, MLA latent dim); bf16
    "2MiB": (32, 16, 8, 128, 576),      # Llama-3.1-8B, 16-token blocks (MLA: 576 KiB)
    "64KiB": (4, 16, 2, 128, 576),      # 4 layers (MLA: 72 KiB)
}
LAYOUTS = ("flash_attn", "flashinfer", "mla")
GOALS = {"2MiB": 0.85, "64KiB": 0.70}
TRANSPORTS = ("auto", "kernel", "staged", "dma")   # each measured; "host": verified on host threads


def _tensors(layout: str, geometry: str, blocks: int) -> list[torch.Tensor]:
    layers, page, heads, dim, latent = GEOMETRIES[geometry]
    shape = {"flash_attn": (2, blocks, page, heads, dim), "flashinfer": (blocks, 2, page, heads, dim),
             "mla": (blocks, page, latent)}[layout]
    out = []
    for _ in range(layers):
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        t.view(torch.int16).random_(-32768, 32767)
        out.append(t)
    return out


def _timed(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps + 1 if reps else 1):   # the first run warms up (compile, pages)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if _ or not reps:        # reps=0: one run, no warm-up
            best = min(best, elapsed)
    return best


def dma_limit(nbytes: int, reps: int) -> tuple[float, float]:
    """The faster of host memory registered as G2 is and torch's own pinned memory."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    registered = AlignedBuffer(nbytes, pin=True)
    best_d2h = best_h2d = float("inf")
    for host in (registered.tensor, torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)):
        best_d2h = min(best_d2h, _timed(lambda: host.copy_(device, non_blocking=True), reps))
        best_h2d = min(best_h2d, _timed(lambda: device.copy_(host, non_blocking=True), reps))
    registered.unpin()
    return nbytes / best_d2h / 1e9, nbytes / best_h2d / 1e9


def naive(tensors, layout: str, src_ids, packed_host: torch.Tensor, reps: int):
    dim = 1 if layout == "flash_attn" else 0
    idx = torch.as_tensor(src_ids, device="cuda")
    per_layer = [t.index_select(dim, idx) for t in tensors]
    packed = torch.empty(sum(p.numel() for p in per_layer) * 2, dtype=torch.uint8, device="cuda")
    host = packed_host[:packed.numel()]

    def offload():
        at = 0
        for t, p in zip(tensors, per_layer):
            n = p.numel() * 2
            torch.index_select(t, dim, idx, out=packed[at:at + n].view(torch.bfloat16).view(p.shape))
            at += n
        host.copy_(packed, non_blocking=True)

    def onboard():
        packed.copy_(host, non_blocking=True)
        at = 0
        for t, p in zip(tensors, per_layer):
            n = p.numel() * 2
            t.index_copy_(dim, idx, packed[at:at + n].view(torch.bfloat16).view(p.shape))
            at += n
    return _timed(offload, reps), _timed(onboard, reps)


def bench_layout(layout: str, geometry: str, batch_bytes: int, reps: int, results: dict,
                 names: tuple[str, ...]) -> None:
    block_bytes = DeviceStorage.wrap(_tensors(layout, geometry, 4)).config.block_bytes
    batch = max(1, batch_bytes // block_bytes)
    pool = 2 * batch
    tensors = _tensors(layout, geometry, pool)
    g1 = DeviceStorage.wrap(tensors)
    cfg = g1.config
    g2 = HostStorage(cfg.with_blocks(pool).with_alignment(4096), verify_reads=True)
    rng = np.random.default_rng(7)
    nbytes = batch * block_bytes
    row = {"layout": layout, "geometry": geometry, "block_bytes": block_bytes, "batch": batch,
           "layers": cfg.num_layers}
    src = rng.choice(pool, batch, replace=False).tolist()
    dst = rng.choice(pool, batch, replace=False).tolist()
    seq = [1000 + i for i in range(batch)]
    # the blocks onboarded land where no source block is, so each can be compared
    back = rng.permutation(np.setdiff1d(np.arange(pool), src))[:batch].tolist()
    engines = {name: DeviceCopyEngine(transport=name) for name in names if name != "host"}
    if "host" in names:   # integrity checked on the host instead (xxh3 on host threads)
        engines["host"] = DeviceCopyEngine(transport="kernel", device_checksums=False)
        row["hash_threads"] = engines["host"].hash_threads
    # built once, outside the timing, as the connector's worker receives them ready-made
    # from the planner (which builds them unvalidated, TransferPlan.trusted)
    offload_plan = TransferPlan.for_path("G1->G2", src, dst, seq, job_id=1)
    onboard_plan = TransferPlan.for_path("G2->G1", dst, back, seq, job_id=1)
    for name, engine in engines.items():
        with TransferEngine({"G1": g1, "G2": g2}, copy_engine=engine) as transfers:
            def run(plan):
                out = transfers.submit(plan).result()
                assert out.all_ok, (name, plan.path, out.failures[:1], out.error)

            # bytes first: G1 -> G2 -> G1 elsewhere, compared block by block
            run(offload_plan)
            run(onboard_plan)
            for s, b in list(zip(src, back))[:64]:      # as int16: random bits hold bf16 NaNs
                assert all(torch.equal(*(t.view(torch.int16)[:, i] if layout == "flash_attn"
                                         else t.view(torch.int16)[i] for i in (s, b)))
                           for t in tensors), (name, layout, geometry, s, b)
            # integrity on: what the connector runs
            off = _timed(lambda: run(offload_plan), reps)
            on = _timed(lambda: run(onboard_plan), reps)
            row[f"{name}_offload_gbs"], row[f"{name}_onboard_gbs"] = nbytes / off / 1e9, \
                nbytes / on / 1e9
            row[f"{name}_used"] = engine.transport_on("cuda")
            row[f"{name}_error"] = engine.kernel_error
            if name != "host":      # the copy alone, no checksums
                row[f"{name}_copy_offload_gbs"] = nbytes / _timed(
                    lambda: engine.copy(g1.memory, src, g2.memory, dst), reps) / 1e9
                row[f"{name}_copy_onboard_gbs"] = nbytes / _timed(
                    lambda: engine.copy(g2.memory, dst, g1.memory, back), reps) / 1e9
            if layout == "flash_attn" and geometry == "2MiB" and name != "host":
                results.setdefault("overlap", {})[name] = overlap(
                    lambda: run(onboard_plan), on)
    n_off, n_on = naive(tensors, layout, src,
                        torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), reps)
    row["naive_offload_gbs"], row["naive_onboard_gbs"] = nbytes / n_off / 1e9, nbytes / n_on / 1e9
    results["rows"].append(row)
    g2.close()


def forward_lasting(seconds: float):
    """A stand-in for an engine's forward: as many bf16 8192^3 matrix products on the
    default stream as take about ``seconds``; ``(queue them, how many)``."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    one = _timed(lambda: a @ b, 3)
    count = max(1, round(seconds / one))

    def forward():
        for _ in range(count):
            a @ b
    return forward, count


def overlap(onboard, onboard_seconds: float) -> dict:
    """Matrix products on the default stream while an onboard runs on its own stream."""
    forward, count = forward_lasting(onboard_seconds)
    alone = _timed(forward, 3)
    load = _timed(onboard, 3)

    def both():
        forward()          # queued on the default stream, returns at once
        onboard()          # its own stream; returns when the load landed

    together = _timed(both, 3)
    return {"forward_s": alone, "onboard_s": load, "both_s": together, "matmuls": count,
            "vs_max": together / max(alone, load), "vs_sum": together / (alone + load)}


def hash_rates(nbytes: int) -> dict:
    """Host checksum throughput over registered memory (what the host-verified path pays)."""
    from kvstrata.physical.checksum import memory_checksums, memory_device_checksums
    buffer = AlignedBuffer(nbytes, pin=True)
    buffer.tensor.random_(0, 256)
    block = 2 << 20
    addresses = buffer.address + np.arange(nbytes // block, dtype=np.uint64) * block
    out = {}
    for threads in (1, 4, 8, 16):
        start = time.perf_counter()
        memory_checksums(addresses, block, threads=threads)
        out[f"xxh3_{threads}t_gbs"] = nbytes / (time.perf_counter() - start) / 1e9
    for threads in (1, 8):
        start = time.perf_counter()
        memory_device_checksums(addresses, block, threads=threads)
        out[f"device_sum_{threads}t_gbs"] = nbytes / (time.perf_counter() - start) / 1e9
    buffer.unpin()
    return out


# (transport, programs, slice MiB): programs None = the default (the SM count)
SWEEP = (("kernel", None, 8), ("kernel", None, 32), ("dma", None, 32), ("staged", None, 8),
         ("staged", None, 32), ("staged", None, 64))


def sweep(batch_bytes: int, reps: int) -> list[dict]:
    """The transports alone (plain and summed), the kernel at several grid sizes, the
    FlashAttention layout; at 2 MiB also the overlap of a summed onboard with matrix products
    on the default stream."""
    rows = []
    for geometry in GEOMETRIES:
        layers, page, heads, dim, _ = GEOMETRIES[geometry]
        block_bytes = layers * 2 * page * heads * dim * 2
        tensors = _tensors("flash_attn", geometry, 2 * max(1, batch_bytes // block_bytes))
        g1 = DeviceStorage.wrap(tensors)
        batch = g1.config.num_blocks // 2
        g2 = HostStorage(g1.config.with_blocks(batch).with_alignment(4096))
        ids, slots = list(range(0, 2 * batch, 2)), list(range(batch))
        nbytes = batch * g1.config.block_bytes
        for transport, programs, slice_mib in SWEEP:
            engine = DeviceCopyEngine(transport=transport, programs=programs,
                                      slice_bytes=slice_mib << 20)
            row = {"geometry": geometry, "transport": engine.transport_on("cuda"),
                   "programs": {None: "SMs", 1 << 30: "pieces"}.get(programs, programs),
                   "slice_mib": slice_mib}
            times = {}
            for name, fn in (
                    ("off", lambda: engine.copy(g1.memory, ids, g2.memory, slots)),
                    ("on", lambda: engine.copy(g2.memory, slots, g1.memory, ids,
                                               direction="onboard")),
                    ("summed_off", lambda: engine.copy_summed(g1.memory, ids, g2.memory, slots)),
                    ("summed_on", lambda: engine.copy_summed(g2.memory, slots, g1.memory, ids,
                                                             direction="onboard"))):
                times[name] = _timed(fn, reps)
                row[name] = nbytes / times[name] / 1e9
            if geometry == "2MiB":
                o = overlap(lambda: engine.copy_summed(g2.memory, slots, g1.memory, ids,
                                                       direction="onboard"),
                            times["summed_on"])
                row["overlap_vs_max"], row["overlap_vs_sum"] = o["vs_max"], o["vs_sum"]
            rows.append(row)
        g2.close()
    return rows


def g3_to_g1(batch_bytes: int, reps: int, directory: str | None, dma_h2d: float) -> dict:
    tensors = _tensors("flash_attn", "2MiB", 2 * max(1, batch_bytes // (2 << 20)))
    g1 = DeviceStorage.wrap(tensors)
    cfg = g1.config.with_alignment(4096)
    batch = max(1, batch_bytes // cfg.block_bytes)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        g2 = HostStorage(cfg.with_blocks(batch), verify_reads=True)
        g3 = DiskStorage(cfg.with_blocks(batch), tmp, o_direct=None)
        rng = np.random.default_rng(3)
        seq = [7000 + i for i in range(batch)]
        with TransferEngine({"G1": g1, "G2": g2, "G3": g3}) as transfers:
            def plan(path, src, dst):
                return TransferPlan.for_path(path, src, dst, seq, job_id=2)

            def run(plan):
                out = transfers.submit(plan).result()
                assert out.all_ok, (plan.path, out.failures[:1], out.error)
            slots = list(range(batch))
            run(plan("G1->G2", slots, slots))
            run(plan("G2->G3", slots, slots))
            back = rng.choice(len(tensors[0][0]), batch, replace=False).tolist()
            load = plan("G3->G1", slots, back)    # built outside the timing
            stride = g3.layout.block_stride
            buffer = AlignedBuffer(stride * batch)
            fd = os.open(g3.path, os.O_RDONLY | (os.O_DIRECT if g3.status().o_direct else 0))

            def raw():
                for i in range(batch):
                    os.preadv(fd, [buffer.array[i * stride:(i + 1) * stride]], i * stride)
            ours = raw_s = float("inf")
            for _ in range(reps):          # interleaved: the disk's drift hits both alike
                ours = min(ours, _timed(lambda: run(load), 0))
                raw_s = min(raw_s, _timed(raw, 0))
            os.close(fd)
        nbytes = batch * cfg.block_bytes
        o_direct = g3.status().o_direct
        g3.close()
    raw_gbs = nbytes / raw_s / 1e9
    return {"ours_gbs": nbytes / ours / 1e9, "raw_o_direct_gbs": raw_gbs, "o_direct": o_direct,
            "limit_gbs": min(raw_gbs, dma_h2d), "ratio": nbytes / ours / 1e9 / min(raw_gbs, dma_h2d)}


def profile_plans(batch_bytes: int, transport: str, out_path: str | None) -> str:
    """Where the host time of a 64 KiB-block offload and onboard with integrity goes
    (cProfile of three of each after a warm-up), as text (also written to ``out_path``)."""
    import cProfile
    import io
    import pstats
    tensors = _tensors("flash_attn", "64KiB", 2 * max(1, batch_bytes // (64 << 10)))
    g1 = DeviceStorage.wrap(tensors)
    batch = g1.config.num_blocks // 2
    g2 = HostStorage(g1.config.with_blocks(batch).with_alignment(4096), verify_reads=True)
    rng = np.random.default_rng(5)
    src = rng.choice(2 * batch, batch, replace=False).tolist()
    slots = rng.permutation(batch).tolist()
    seq = [5000 + i for i in range(batch)]
    text = io.StringIO()
    with TransferEngine({"G1": g1, "G2": g2},
                        copy_engine=DeviceCopyEngine(transport=transport)) as transfers:
        plans = [TransferPlan.for_path(path, a, b, seq, job_id=3)     # ready-made, as
                 for path, a, b in (("G1->G2", src, slots), ("G2->G1", slots, src))]  # ever

        def both():   # on this thread (not the engine's workers), so the profiler sees it
            for plan in plans:
                out = transfers._execute(plan)
                assert out.all_ok, (plan.path, out.failures[:1], out.error)
        both()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3):
            both()
        profiler.disable()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumulative").print_stats(30)
    g2.close()
    if out_path:
        with open(out_path, "w") as f:
            f.write(text.getvalue())
    return text.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB batches, 3 runs")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--batch-mib", type=int, default=None)
    parser.add_argument("--dir", default=None, help="directory for the G3 slab")
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the transports alone at other launch shapes")
    parser.add_argument("--transports", default=",".join(TRANSPORTS) + ",host",
                        help="which to measure through the transfer engine (comma-separated; "
                             "host: verified on host threads)")
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="also profile the host side of 64 KiB plans, to PATH")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_copy: needs a CUDA GPU (none here)", file=sys.stderr)
        return 2
    batch_bytes = (args.batch_mib or (64 if args.quick else 256)) << 20
    reps = args.reps or (3 if args.quick else 5)
    d2h, h2d = dma_limit(batch_bytes, reps)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "batch_bytes": batch_bytes, "reps": reps, "dma_d2h_gbs": d2h, "dma_h2d_gbs": h2d,
               "rows": []}
    print(f"{results['device']}: DMA limit D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s "
          f"({batch_bytes >> 20} MiB contiguous, registered host memory)", flush=True)
    names = tuple(n for n in args.transports.split(",") if n)
    for geometry in GEOMETRIES:
        for layout in LAYOUTS:
            bench_layout(layout, geometry, batch_bytes, reps, results, names)
            r = results["rows"][-1]
            print(f"  {geometry:6} {layout:10} " + "  ".join(
                f"{n} {r[n + '_offload_gbs']:5.1f}/{r[n + '_onboard_gbs']:5.1f} "
                f"({r[n + '_used']})" for n in names), flush=True)
            for n in names:
                if r[n + "_error"]:
                    print(f"    {n}: {r[n + '_error']}", flush=True)
    results["g3_to_g1"] = g3_to_g1(batch_bytes, reps, args.dir, h2d)
    results["hash_rates"] = hash_rates(batch_bytes)
    if args.sweep:
        results["sweep"] = sweep(batch_bytes, reps)
    if args.profile:
        with open(args.profile, "w") as f:
            for transport in ("kernel", "staged"):
                f.write(f"=== {transport}\n" + profile_plans(batch_bytes, transport, None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\nbatch {batch_bytes >> 20} MiB of scattered blocks, best of {reps}; GB/s "
          f"(ratio to the DMA limit, D2H for offload, H2D for onboard)")
    print("GB/s offload/onboard (ratio to the DMA limit: D2H for offload, H2D for onboard). "
          "naive: index_select + one DMA; copy: the transport alone; kvstrata: TransferEngine "
          "plans with integrity on (device checksums); host-verified: xxh3 on host threads")
    copies = [n for n in names if n != "host"]
    print(f"{'geometry':8} {'layout':10} {'block':>7} | {'naive':>11} | "
          + " | ".join(f"{n + ' copy':>11}" for n in copies) + " | "
          + " | ".join(f"{'kvstrata ' + n:>21}" for n in copies)
          + (f" | {'host-verified':>13}" if "host" in names else "") + " | goal")
    for r in results["rows"]:
        def pair(key, ratios=False):
            off, on = r[key + "_offload_gbs"], r[key + "_onboard_gbs"]
            text = f"{off:4.1f}/{on:4.1f}"
            return text + (f" ({off / d2h:.2f}/{on / h2d:.2f})" if ratios else "")
        print(f"{r['geometry']:8} {r['layout']:10} {r['block_bytes'] >> 10:>5}Ki | "
              f"{pair('naive'):>11} | "
              + " | ".join(f"{pair(n + '_copy'):>11}" for n in copies) + " | "
              + " | ".join(f"{pair(n, True):>21}" for n in copies)
              + (f" | {pair('host'):>13}" if "host" in names else "")
              + f" | >={GOALS[r['geometry']]:.2f}")
    print("host hashing of 2 MiB blocks in registered memory, GB/s: " + ", ".join(
        f"{k[:-4]} {v:.1f}" for k, v in results["hash_rates"].items()))
    for r in results.get("sweep", []):
        overlap = (f"  overlap with matmuls {r['overlap_vs_max']:.2f} x max, "
                   f"{r['overlap_vs_sum']:.2f} x sum" if "overlap_vs_max" in r else "")
        print(f"sweep {r['geometry']:6} {r['transport']:6} programs {str(r['programs']):>6} "
              f"slices {r['slice_mib']:>2} MiB: "
              f"off {r['off']:5.1f} "
              f"on {r['on']:5.1f} summed off {r['summed_off']:5.1f} on {r['summed_on']:5.1f}"
              + overlap)
    for name, o in results.get("overlap", {}).items():
        print(f"overlap ({name}): {o['matmuls']} bf16 8192^3 matmuls {o['forward_s'] * 1e3:.1f} "
              f"ms, onboard {o['onboard_s'] * 1e3:.1f} ms, both {o['both_s'] * 1e3:.1f} ms = "
              f"{o['vs_max']:.2f} x max, {o['vs_sum']:.2f} x sum")
    g = results["g3_to_g1"]
    print(f"G3->G1: {g['ours_gbs']:.1f} GB/s vs raw preadv {g['raw_o_direct_gbs']:.1f} GB/s "
          f"(o_direct={g['o_direct']}), DMA {h2d:.1f}: ratio {g['ratio']:.2f} to the lower")
    for r in results["rows"]:
        for name in copies:
            ratio = min(r[name + "_offload_gbs"] / d2h, r[name + "_onboard_gbs"] / h2d)
            print(f"RESULT name=gpu_copy_{r['geometry']}_{r['layout']}_{name} "
                  f"ours={min(r[name + '_offload_gbs'], r[name + '_onboard_gbs']):.1f}GB/s "
                  f"baseline={min(d2h, h2d):.1f}GB/s ratio={ratio:.2f} "
                  f"goal>={GOALS[r['geometry']]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
