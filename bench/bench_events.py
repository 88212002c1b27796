"""Events per second delivered end to end through NATS, beside a raw nats-py publish loop.

ours:     EventPublisher hooks (the registry's observer calls) -> batching thread -> kvstrata
          JSON encode -> NatsSink -> nats-server -> subscriber process counting events.
baseline: the same payload bytes (recorded from the ours run) published by a bare nats-py loop
          -> nats-server -> the same subscriber process.

The subscriber runs in its own process (so it does not share the GIL with the producer) and
counts events by decoding each message (``json.loads`` and ``len(events)``), the least any
consumer must do. Rate = events / (time of last event received - time producing started).

Prints ``RESULT name=events_nats ours=<events/s> baseline=<events/s> ratio=<ours/baseline>``
(best of each side), the median ratio of the back-to-back pairs, and the producer process's CPU
per event (hooks, batching thread, encoding, nats-py: every thread of the process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

SUBSCRIBER = r"""
import asyncio, json, sys, time
import nats

async def main(url, subject, expected):
    nc = await nats.connect(url)
    count = 0
    done = asyncio.Event()
    last = 0.0
    async def cb(msg):
        nonlocal count, last
        count += len(json.loads(msg.data)["events"])
        if count >= expected:
            last = time.time()
            done.set()
    await nc.subscribe(subject, cb=cb, pending_msgs_limit=10_000_000, pending_bytes_limit=-1)
    await nc.flush()
    print("READY", flush=True)
    try:
        await asyncio.wait_for(done.wait(), 300)
    finally:
        print(json.dumps({"count": count, "last": last}), flush=True)
        await nc.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def start_subscriber(url: str, subject: str, expected: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", SUBSCRIBER, url, subject, str(expected)],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if line.strip() != "READY":
        raise RuntimeError(f"subscriber failed to start: {line!r}")
    return proc


def finish_subscriber(proc: subprocess.Popen) -> dict:
    out = proc.stdout.readline()
    proc.wait(30)
    return json.loads(out)


def make_workload(n_events: int, blocks_per_event: int):
    from kvstrata.events.testing import chain

    # Each iteration: one stored event (a chain) and one removed event (its last block).
    chains = [chain(i, blocks_per_event) for i in range(n_events // 2)]
    return chains


def run_ours(url: str, subject: str, chains, max_batch: int) -> tuple[float, list[bytes], dict]:
    from kvstrata.events import EventPublisher
    from kvstrata.events.sinks import NatsSink

    class RecordingNatsSink(NatsSink):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.payloads: list[bytes] = []

        def encode(self, batch, max_payload):
            payloads, ids = super().encode(batch, max_payload)
            self.payloads.extend(payloads)
            return payloads, ids

    n_events = 2 * len(chains)
    sink = RecordingNatsSink(url, subject, serve_snapshots=False)
    pub = EventPublisher(sink, max_batch=max_batch, buffer_events=max(4 * n_events, max_batch)).start()
    deadline = time.monotonic() + 10
    while not sink.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    sub = start_subscriber(url, subject, n_events)
    cpu0 = time.process_time()
    t0 = time.time()
    for c in chains:
        pub.on_tier_stored("G1", c)
        pub.on_tier_removed("G1", (c[-1].sequence_hash,))
    produced = time.time()
    pub.flush(60)
    cpu = time.process_time() - cpu0  # every thread of this process: hooks, encoding, nats-py
    res = finish_subscriber(sub)
    metrics = pub.metrics()
    pub.close()
    if res["count"] < n_events:
        raise RuntimeError(f"subscriber got {res['count']} of {n_events} events; metrics {metrics}")
    rate = n_events / (res["last"] - t0)
    return rate, sink.payloads, {**metrics, "produce_s": produced - t0, "e2e_s": res["last"] - t0, "cpu_s": cpu}


def run_raw(url: str, subject: str, payloads: list[bytes], n_events: int) -> float:
    import nats

    async def main() -> float:
        nc = await nats.connect(url)
        sub = start_subscriber(url, subject, n_events)
        t0 = time.time()
        for p in payloads:
            await nc.publish(subject, p)
        await nc.flush()
        res = await asyncio.get_running_loop().run_in_executor(None, finish_subscriber, sub)
        await nc.close()
        if res["count"] < n_events:
            raise RuntimeError(f"subscriber got {res['count']} of {n_events}")
        return n_events / (res["last"] - t0)

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short run (CI smoke)")
    ap.add_argument("--events", type=int, default=None, help="events per run (default 200k, quick 20k)")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per stored event (default %(default)s)")
    ap.add_argument("--batch", type=int, default=1024, help="publisher max_batch (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=None, help="runs of each side, best kept (default 3, quick 1)")
    args = ap.parse_args(argv)
    n = args.events or (20_000 if args.quick else 200_000)
    repeat = args.repeat or (1 if args.quick else 3)

    from kvstrata.events.natsserver import NatsServer

    chains = make_workload(n, args.blocks)
    n_events = 2 * len(chains)
    with NatsServer() as server:
        best_ours = best_raw = 0.0
        pair_ratios, cpu_us = [], []
        for i in range(repeat):
            rate, payloads, info = run_ours(server.url, f"bench.ours.{i}", chains, args.batch)
            raw = run_raw(server.url, f"bench.raw.{i}", payloads, n_events)
            print(
                f"run {i}: ours {rate:,.0f} ev/s (produce {info['produce_s']:.3f}s, e2e {info['e2e_s']:.3f}s, "
                f"producer cpu {info['cpu_s']:.3f}s, "
                f"{len(payloads)} msgs, {sum(map(len, payloads)) / len(payloads) / 1024:.1f} KiB avg); raw {raw:,.0f} ev/s"
                f"; pair ratio {rate / raw:.3f}",
                flush=True,
            )
            best_ours, best_raw = max(best_ours, rate), max(best_raw, raw)
            pair_ratios.append(rate / raw)
            cpu_us.append(info["cpu_s"] / n_events * 1e6)
    # Best of each side is the figure on a quiet machine; on a loaded one the median of the
    # back-to-back pairs is steadier, and the producer's CPU per event steadier still.
    print(f"RESULT name=events_nats ours={best_ours:.0f} baseline={best_raw:.0f} ratio={best_ours / best_raw:.3f} "
          f"median_pair_ratio={statistics.median(pair_ratios):.3f} "
          f"producer_cpu_us_per_event={statistics.median(cpu_us):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
