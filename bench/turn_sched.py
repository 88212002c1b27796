"""Who had the CPUs while each timed turn ran: a kernel scheduler trace read against a
connector or cost-model benchmark's ``--json`` output.

On a shared machine a turn can be slower than its same-run counterpart because other
processes took the cores meanwhile; this says, per turn, how much CPU time went to the
engine's own threads (its busiest two, the compute threads, apart), to the benchmark's stand-in
services (the object store and the slow link, ``standin_pids`` of each configuration, or of
the whole output in older files), to every other process, and how long the CPUs stood idle.
A ``--runs N`` output is read run by run. Record the trace around the benchmark and convert it::

    perf record -e sched:sched_switch -e sched:sched_wakeup -a -k CLOCK_MONOTONIC \\
        -o sched.data -- python bench/bench_cost_model.py --configs recompute,slow-on \\
        --json run.json
    perf sched timehist -i sched.data > sched.txt
    python bench/turn_sched.py sched.txt run.json

(``-k CLOCK_MONOTONIC``: the trace's clock is the one the turns' ``turn_cpu.monotonic``
timestamps are taken with.) Prints one line per turn; reads, never asserts.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
from collections import Counter, defaultdict

_LINE = re.compile(r"^\s*(\d+\.\d+)\s+\[(\d+)\]\s+(.*?)\[(\d+)(?:/(\d+))?\]\s+[\d.]+\s+[\d.]+"
                   r"\s+([\d.]+)")


def read_runs(path: str) -> list[tuple[float, float, int, int, str]]:
    """(start, end, tid, pid, comm) of every stretch a task ran, from ``perf sched
    timehist`` text (its lines end a run: time, CPU, task[tid/pid], waited, delay, ran)."""
    runs = []
    with open(path) as f:
        for line in f:
            m = _LINE.match(line)
            if m is None:
                continue
            end, _cpu, comm, tid, pid, ran = m.groups()
            end = float(end)
            runs.append((end - float(ran) / 1e3, end, int(tid), int(pid or tid), comm.strip()))
    runs.sort()
    return runs


def per_turn(runs: list, starts: list[float], a: float, b: float) -> Counter:
    """CPU seconds each (tid, pid, comm) ran within [a, b]."""
    got: Counter = Counter()
    i = max(0, bisect.bisect_left(starts, a) - 1)
    # a run may have started well before a: step back over long runs
    while i > 0 and runs[i - 1][1] > a:
        i -= 1
    for start, end, tid, pid, comm in runs[i:]:
        if start >= b:
            break
        overlap = min(end, b) - max(start, a)
        if overlap > 0:
            got[tid, pid, comm] += overlap
    return got


def report(runs: list, result: dict, name: str, standins: set[int]) -> None:
    engine = set(result.get("pids") or ())
    starts = [r[0] for r in runs]
    print(f"{name}: engine pids {sorted(engine)}")
    print(f"  {'conv/turn':>9} {'TTFT':>7} {'compute':>8} {'engine rest':>11} "
          f"{'stand-ins':>9} {'others':>7} {'idle':>6}  busiest other processes (ms)")
    for t in result.get("turns", ()):
        window = (t.get("turn_cpu") or {}).get("monotonic")
        if not window:
            continue
        got = per_turn(runs, starts, *window)
        ours = Counter({k: v for k, v in got.items() if k[1] in engine})
        compute = sum(v for _, v in ours.most_common(2))
        rest = sum(ours.values()) - compute
        stand = sum(v for k, v in got.items() if k[1] in standins)
        idle = sum(v for k, v in got.items() if k[0] == 0)
        others: defaultdict[str, float] = defaultdict(float)
        for (tid, pid, comm), v in got.items():
            if tid and pid not in engine and pid not in standins:
                others[comm] += v
        top = sorted(others.items(), key=lambda kv: -kv[1])[:3]
        print(f"  {t['conv']:>5}/{t['turn']:<3} {t['ttft_s'] * 1e3:>7,.0f} "
              f"{compute * 1e3:>8,.0f} {rest * 1e3:>11,.0f} {stand * 1e3:>9,.0f} "
              f"{sum(others.values()) * 1e3:>7,.0f} {idle * 1e3:>6,.0f}  "
              + ", ".join(f"{c} {v * 1e3:,.0f}" for c, v in top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timehist", help="`perf sched timehist` output")
    parser.add_argument("bench_json", help="the benchmark's --json output")
    parser.add_argument("--configs", default=None, help="comma-separated (default: all)")
    args = parser.parse_args()
    data = json.load(open(args.bench_json))
    everywhere = {int(x) for x in str(data.get("standin_pids") or "").split(",") if x}
    played = [r["results"] for r in data["runs"]] if "runs" in data else [data["results"]]
    runs = read_runs(args.timehist)
    for i, results in enumerate(played):
        for name in args.configs.split(",") if args.configs else list(results):
            if name not in results:
                continue
            standins = set(results[name].get("standin_pids") or ()) or everywhere
            label = f"run {i + 1} {name}" if len(played) > 1 else name
            report(runs, results[name], label, standins)


if __name__ == "__main__":
    main()
