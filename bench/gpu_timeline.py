"""Where the time of a verified G1 <-> G2 plan goes on a GPU: the diagnostic beside
``bench_gpu_copy.py`` (which gives the figures against the DMA limit).

For each case (block geometry, G1 layout, transport, G2 slots), 256 MiB of randomly scattered
G1 blocks, as ``bench_gpu_copy.py`` moves them, into G2 slots scattered at random or as the
pool hands them out (runs of consecutive slots, see ``RUN``), best of ``--reps``, each
direction:

* **plan**: a TransferEngine plan with integrity on (device checksums), submitted and waited
  for, as the connector runs it;
* **execute**: the same plan run on this thread (no hop to the engine's worker);
* **summed** / **copy**: the copy engine's ``copy_summed`` / ``copy`` alone;
* **timeline**: one plan each way under torch's profiler: how much of the plan's wall time
  the GPU was busy (kernels and copies, union over streams, and per stream), the host time
  before the GPU's first operation and after its last, and the longest idle gaps inside,
  each with how long before it the host had queued the operation that ended it (near zero:
  the host was late; large: the GPU waited on something queued);
* with ``--knobs``: ``copy_summed`` alone at other kernel shapes (warps, grid, slice size);
* **overlap**: a verified onboard (2 MiB blocks, FlashAttention, ``auto``, which stages them)
  beside bf16 matrix products on the default stream (``bench_gpu_copy.overlap``: both
  together against the longer alone), at each staging depth (``OVERLAP_DEPTHS``: buffers a
  direction's slices take turns in), and one profiled run of both: each stream's busy time
  and when its last operation ended. Where the pack kernel waits for SMs the matrix
  products hold, a deeper ring lets the DMA run on (what this measures).

Prints a table; ``--out DIR`` also writes every figure (``timeline.json``) and the trace
events read, per case, in one gzipped JSON (``traces.json.gz``). Needs CUDA; exits 2
without it. Usage:
``python bench/gpu_timeline.py [--reps N] [--batch-mib M] [--knobs] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_copy import _tensors, _timed, forward_lasting, overlap  # noqa: E402

from kvstrata.physical import (DeviceStorage, HostStorage, TransferEngine,  # noqa: E402
                               TransferPlan)
from kvstrata.physical.device_copy import DeviceCopyEngine  # noqa: E402

CASES = (("2MiB", "flash_attn", "auto", "random"), ("2MiB", "flash_attn", "kernel", "random"),
         ("64KiB", "flash_attn", "auto", "random"), ("64KiB", "flash_attn", "staged", "random"),
         ("2MiB", "mla", "auto", "random"), ("64KiB", "flash_attn", "auto", "pool"),
         ("64KiB", "flash_attn", "kernel", "pool"))
RUN = 32
"""G2 slots ``pool``-allocated: runs of this many consecutive slots, each handed out last
slot first, the runs at random places (what the pool's free stack and tail-first eviction
give; ``bench/staging_runs.py`` counts 25-32 blocks per run in the packaged trace's replay)."""
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
OVERLAP_DEPTHS = (2, 4, 8)


class Setup:
    """G1 on the GPU, a verifying G2 and the random ids of one case."""

    def __init__(self, geometry: str, layout: str, batch_bytes: int,
                 slots: str = "random") -> None:
        block_bytes = DeviceStorage.wrap(_tensors(layout, geometry, 4)).config.block_bytes
        self.batch = max(1, batch_bytes // block_bytes)
        pool = 2 * self.batch
        self.g1 = DeviceStorage.wrap(_tensors(layout, geometry, pool))
        self.g2 = HostStorage(self.g1.config.with_blocks(pool).with_alignment(4096),
                              verify_reads=True)
        rng = np.random.default_rng(11)
        self.src = rng.choice(pool, self.batch, replace=False).tolist()
        if slots == "pool":
            starts = rng.permutation(pool // RUN)[:-(-self.batch // RUN)] * RUN
            self.slots = [int(s + RUN - 1 - i) for s in starts for i in range(RUN)][:self.batch]
            assert len(self.slots) == self.batch, "pool slots need a batch of RUN blocks or more"
        else:
            self.slots = rng.choice(pool, self.batch, replace=False).tolist()
        self.back = rng.permutation(np.setdiff1d(np.arange(pool), self.src))[:self.batch].tolist()
        self.seq = [3000 + i for i in range(self.batch)]
        self.nbytes = self.batch * self.g1.config.block_bytes
        self.block_bytes = self.g1.config.block_bytes

    def plans(self):
        return (TransferPlan.for_path("G1->G2", self.src, self.slots, self.seq, job_id=1),
                TransferPlan.for_path("G2->G1", self.slots, self.back, self.seq, job_id=1))

    def close(self) -> None:
        self.g2.close()


def measure(setup: Setup, engine: DeviceCopyEngine, reps: int) -> dict:
    row: dict = {"batch": setup.batch, "block_bytes": setup.block_bytes}
    off_plan, on_plan = setup.plans()
    g1, g2 = setup.g1.memory, setup.g2.memory
    with TransferEngine({"G1": setup.g1, "G2": setup.g2}, copy_engine=engine) as transfers:
        def submitted(plan):
            out = transfers.submit(plan).result()
            assert out.all_ok, (plan.path, out.failures[:1], out.error)

        def executed(plan):
            out = transfers._execute(plan)
            assert out.all_ok, (plan.path, out.failures[:1], out.error)

        submitted(off_plan)
        submitted(on_plan)
        row["transport_used"] = engine.transport_on("cuda")
        for name, off, on in (
                ("plan", lambda: submitted(off_plan), lambda: submitted(on_plan)),
                ("execute", lambda: executed(off_plan), lambda: executed(on_plan)),
                ("summed", lambda: engine.copy_summed(g1, setup.src, g2, setup.slots),
                 lambda: engine.copy_summed(g2, setup.slots, g1, setup.back,
                                            direction="onboard")),
                ("copy", lambda: engine.copy(g1, setup.src, g2, setup.slots),
                 lambda: engine.copy(g2, setup.slots, g1, setup.back, direction="onboard"))):
            row[f"{name}_offload_gbs"] = setup.nbytes / _timed(off, reps) / 1e9
            row[f"{name}_onboard_gbs"] = setup.nbytes / _timed(on, reps) / 1e9
        row["timeline"], row["trace"] = timeline(executed, (off_plan, on_plan))
    return row


def timeline(run, plans) -> tuple[dict, list[dict]]:
    """Profile one run of each plan (after the warm-up the caller did): the summary and the
    trace's events that it reads."""
    kept = profiled([(f"plan {plan.path}", lambda plan=plan: run(plan)) for plan in plans])
    return summarise(kept), kept


def profiled(steps) -> list[dict]:
    """Run each ``(name, fn)`` of ``steps`` under torch's profiler, annotated ``name`` and
    waited for on the device: the trace's events :func:`summarise` reads (GPU operations,
    runtime calls, the annotations)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, fn in steps:
            with record_function(name):
                fn()
                torch.cuda.synchronize()
    path = f"/tmp/kvstrata-trace-{os.getpid()}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in (
        *GPU_CATEGORIES, "cuda_runtime", "cuda_driver", "user_annotation")]


def summarise(events: list[dict]) -> dict:
    """From a chrome trace: per ``plan ...`` annotation, GPU busy time over the plan's wall
    time, per stream, the host-only head and tail, and the five longest idle gaps."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
               and "correlation" in e.get("args", {})}
    out = {}
    for window in (e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                   and str(e.get("name", "")).startswith("plan ")):
        lo, hi = window["ts"], window["ts"] + window["dur"]
        inside = sorted((e for e in gpu if lo <= e["ts"] < hi), key=lambda e: e["ts"])
        if not inside:
            out[window["name"]] = {"wall_us": window["dur"], "gpu_ops": 0}
            continue
        busy, streams, ends, gaps = 0.0, {}, {}, []
        cur_start, cur_end = inside[0]["ts"], inside[0]["ts"] + inside[0]["dur"]
        for e in inside:
            start, end = e["ts"], e["ts"] + e["dur"]
            key = f"{e.get('args', {}).get('stream', '?')} {e['cat']}"
            streams[key] = streams.get(key, 0.0) + e["dur"]
            ends[key] = max(ends.get(key, 0.0), end - lo)
            if start > cur_end:
                busy += cur_end - cur_start
                launched = runtime.get(e.get("args", {}).get("correlation"))
                gaps.append({"gap_us": start - cur_end, "next": str(e["name"])[:60],
                             "queued_before_us": (start - launched["ts"]) if launched else None,
                             "queued_by": launched["name"] if launched else None})
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        busy += cur_end - cur_start
        last = max(e["ts"] + e["dur"] for e in inside)
        out[window["name"]] = {
            "wall_us": window["dur"], "gpu_busy_us": busy, "busy_share": busy / window["dur"],
            "head_us": inside[0]["ts"] - lo, "tail_us": hi - last, "gpu_ops": len(inside),
            "idle_inside_us": sum(g["gap_us"] for g in gaps),
            "streams_us": streams, "streams_end_us": ends,
            "longest_gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:5]}
    return out


def knobs(batch_bytes: int, reps: int) -> list[dict]:
    """``copy_summed`` alone, random ids, at other kernel shapes and slice sizes."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = [("64KiB", "kernel", dict()), ("64KiB", "kernel", dict(num_warps=8)),
                ("64KiB", "kernel", dict(programs=4 * sms)),
                ("64KiB", "kernel", dict(programs=16 * sms)),
                ("64KiB", "kernel", dict(programs=4 * sms, num_warps=8)),
                ("64KiB", "kernel", dict(slice_bytes=64 << 20)),
                ("2MiB", "kernel", dict()), ("2MiB", "kernel", dict(num_warps=8)),
                ("2MiB", "kernel", dict(programs=4 * sms)),
                ("2MiB", "kernel", dict(block_elements=1024)),   # fewer registers a thread
                ("2MiB", "staged", dict()), ("2MiB", "staged", dict(slice_bytes=64 << 20)),
                ("2MiB", "staged", dict(slice_bytes=128 << 20)),
                ("2MiB", "staged", dict(programs=4 * sms))]
    rows, setups = [], {}
    for geometry, transport, kwargs in variants:
        setup = setups.get(geometry)
        if setup is None:
            setup = setups[geometry] = Setup(geometry, "flash_attn", batch_bytes)
        engine = DeviceCopyEngine(transport=transport, **kwargs)
        g1, g2 = setup.g1.memory, setup.g2.memory
        row = {"geometry": geometry, "transport": transport,
               "knobs": {k: v for k, v in kwargs.items()}}
        for name, fn in (
                ("summed_offload_gbs", lambda: engine.copy_summed(g1, setup.src, g2, setup.slots)),
                ("summed_onboard_gbs", lambda: engine.copy_summed(
                    g2, setup.slots, g1, setup.back, direction="onboard")),
                ("copy_offload_gbs", lambda: engine.copy(g1, setup.src, g2, setup.slots)),
                ("copy_onboard_gbs", lambda: engine.copy(g2, setup.slots, g1, setup.back,
                                                         direction="onboard"))):
            row[name] = setup.nbytes / _timed(fn, reps) / 1e9
        row["used"] = engine.transport_on("cuda")
        engine.close()
        rows.append(row)
    for setup in setups.values():
        setup.close()
    return rows


def overlap_cases(batch_bytes: int, reps: int):
    """The overlap of an onboard with a forward at each of ``OVERLAP_DEPTHS`` (see the
    module docstring): yields a row per depth as it is measured."""
    setup = Setup("2MiB", "flash_attn", batch_bytes)
    off_plan, on_plan = setup.plans()
    rows = []
    for depth in OVERLAP_DEPTHS:
        engine = DeviceCopyEngine(transport="auto", staging_depth=depth)
        with TransferEngine({"G1": setup.g1, "G2": setup.g2}, copy_engine=engine) as transfers:
            def run(plan):
                out = transfers.submit(plan).result()
                assert out.all_ok, (plan.path, out.failures[:1], out.error)
            run(off_plan)
            run(on_plan)
            row = overlap(lambda: run(on_plan), _timed(lambda: run(on_plan), reps))
            forward, _ = forward_lasting(row["onboard_s"])

            def both():
                forward()         # queued on the default stream
                run(on_plan)      # its own streams; returns when it landed
            events = profiled([(f"plan overlap depth {depth}", both)])
            row.update(depth=depth, used=engine.transport_on("cuda"),
                       timeline=summarise(events))
        engine.close()
        yield row
    setup.close()


def print_overlap(r: dict) -> None:
    t = next(iter(r["timeline"].values()), {})
    ends = ", ".join(f"{k}: {v:.0f} us" for k, v in t.get("streams_end_us", {}).items())
    print(f"overlap depth {r['depth']} ({r['used']}): both {r['both_s'] * 1e3:.2f} ms = "
          f"{r['vs_max']:.2f} x max, {r['vs_sum']:.2f} x sum (forward "
          f"{r['forward_s'] * 1e3:.2f} ms, {r['matmuls']} products; onboard "
          f"{r['onboard_s'] * 1e3:.2f} ms); profiled, streams end at {ends}", flush=True)


def save(results: dict, traces: dict, out: str | None) -> None:
    """Write what was measured so far (again after each later step: a step cut short by
    the time limit keeps what came before)."""
    if not out:
        return
    with open(os.path.join(out, "timeline.json"), "w") as f:
        json.dump(results, f, indent=1)
    with gzip.open(os.path.join(out, "traces.json.gz"), "wt") as f:
        json.dump(traces, f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch-mib", type=int, default=256)
    parser.add_argument("--knobs", action="store_true")
    parser.add_argument("--out", default=None, help="directory for timeline.json and traces")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_timeline: needs a CUDA GPU (none here)", file=sys.stderr)
        return 2
    batch_bytes = args.batch_mib << 20
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(), "cases": []}
    traces: dict[str, list[dict]] = {}
    started = time.perf_counter()
    for geometry, layout, transport, slots in CASES:
        setup = Setup(geometry, layout, batch_bytes, slots)
        engine = DeviceCopyEngine(transport=transport)
        row = measure(setup, engine, args.reps)
        row.update(geometry=geometry, layout=layout, transport=transport, slots=slots)
        traces[f"{geometry} {layout} {transport} {slots}"] = row.pop("trace")
        results["cases"].append(row)
        engine.close()
        setup.close()
        print(f"{geometry:6} {layout:10} {transport:6} {slots:6} ({row['transport_used']}): "
              + "  ".join(
            f"{n} {row[n + '_offload_gbs']:5.1f}/{row[n + '_onboard_gbs']:5.1f}"
            for n in ("plan", "execute", "summed", "copy")), flush=True)
        for name, t in row["timeline"].items():
            if not t.get("gpu_ops"):
                print(f"    {name}: no GPU operation seen", flush=True)
                continue
            print(f"    {name}: wall {t['wall_us']:.0f} us, GPU busy {t['busy_share']:.2f}, "
                  f"head {t['head_us']:.0f} us, tail {t['tail_us']:.0f} us, idle inside "
                  f"{t['idle_inside_us']:.0f} us over {t['gpu_ops']} ops; streams "
                  + ", ".join(f"{k}: {v:.0f}" for k, v in t["streams_us"].items()), flush=True)
            for g in t["longest_gaps"][:3]:
                queued = ("?" if g["queued_before_us"] is None
                          else f"{g['queued_before_us']:.0f} us before")
                print(f"      gap {g['gap_us']:.0f} us before {g['next']} (queued {queued} "
                      f"by {g['queued_by']})", flush=True)
    if args.knobs:
        results["knobs"] = knobs(batch_bytes, args.reps)
        for r in results["knobs"]:
            print(f"knobs {r['geometry']:6} {r['transport']:6} {str(r['knobs']):40} "
                  f"summed {r['summed_offload_gbs']:5.1f}/{r['summed_onboard_gbs']:5.1f}  "
                  f"copy {r['copy_offload_gbs']:5.1f}/{r['copy_onboard_gbs']:5.1f} ({r['used']})",
                  flush=True)
    save(results, traces, args.out)
    results["overlap"] = []
    try:
        for row in overlap_cases(batch_bytes, args.reps):
            results["overlap"].append(row)
            print_overlap(row)
            save(results, traces, args.out)
    except Exception as exc:     # noqa: BLE001 - what came before is kept and said
        results["overlap_error"] = f"{type(exc).__name__}: {exc}"
        print(f"overlap: {results['overlap_error']}", flush=True)
    results["seconds"] = time.perf_counter() - started
    save(results, traces, args.out)
    print(f"gpu_timeline: {results['seconds']:.0f} s")
    return 0 if "overlap_error" not in results else 1


if __name__ == "__main__":
    sys.exit(main())
