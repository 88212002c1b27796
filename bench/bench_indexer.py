"""The indexer against Dynamo's KV-router ``RadixTree`` on the same Dynamo RouterEvent bytes.

Two workloads, each written once to a JSON-lines file of Dynamo RouterEvents (the format of
``kvstrata replay --events dynamo-json:FILE``):

* ``trace``: the shipped conversation trace replayed through the default tiers (G1/G2/G3),
  every stored and removed event the replay publishes (82 K events, 1.5 M block operations;
  ``--quick``: the first 2,000 requests);
* ``scale``: ``--blocks`` stored blocks (default 1 M; ``--blocks 10000000`` for 10 M) across 64
  workers in chains of 64 blocks: each chain starts with one of 256 16-block prefixes (system
  prompts; every prefix is on every worker, so its nodes have 64 holders and a query matches
  on all 64 workers) and ends with 48 blocks of its own.

Each side runs in its own process, started fresh per run; runs alternate (ours, peer, ours,
peer, ...) and each figure is the best of ``--repeats``:

* ingest: events/s and blocks/s, from the lines in memory to an updated index. kvstrata:
  ``decode_line`` + ``StreamFollower.feed`` + ``PrefixIndex`` (what ``kvstrata indexer --file``
  and the NATS follower do per message). Dynamo: ``RadixTree.apply_event(worker, bytes)``,
  which takes the inner KvCacheEvent (the ``"event"`` object, cut out of the same line before
  the clock starts) and a worker id; every (worker, storage tier) pair gets its own id so both
  trees hold the same holders.
* query: prefixes from the root by local (tokens) hashes: ``PrefixIndex.match_local`` (which
  answers {worker: {tier: prefix}} as Python dicts) vs ``RadixTree.find_matches(q).scores``
  (its answer as a Python dict), the same lists of ints (``--queries`` of them, at most); the
  peer's bare ``find_matches`` (a Rust object, scores not read) is printed too.
* memory: growth of the process's RSS from before ingest to after it, per stored block.

The peer runs in ``.venv-peers`` (``scripts/setup_peers.sh``) found from this repository's
root; without it the peer is skipped and said so. Prints ``RESULT`` lines: ratio = ours/peer
(speed: goal >= 1; bytes per block: goal <= 1.5).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
TIERS = ("device", "host_pinned", "disk", "external")


# --------------------------------------------------------------------------------------------
# workloads (parent process, .venv)
# --------------------------------------------------------------------------------------------


def write_trace_events(path: Path, limit: int | None) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from kvstrata.config import load_config
    from kvstrata.events import make_publisher
    from kvstrata.replay import load_trace, replay

    requests = load_trace()
    if limit:
        requests = requests[:limit]
    publisher = make_publisher(f"dynamo-json:{path}", worker_id=7, buffer_events=1 << 22)
    replay(requests, load_config(env={}), granularity="trace", observers=[publisher])
    assert publisher.flush(120)
    publisher.close()
    assert publisher.metrics()["dropped"] == 0


def write_scale_events(path: Path, blocks: int, workers: int = 64, chain: int = 64,
                       shared_prefixes: int = 256, shared_len: int = 16, seed: int = 13) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    chains = blocks // chain
    pre_seq = rng.integers(0, 2**64, size=(shared_prefixes, shared_len), dtype=np.uint64)
    pre_loc = rng.integers(0, 2**64, size=(shared_prefixes, shared_len), dtype=np.uint64)
    uniq = chain - shared_len
    block_fmt = '{"block_hash":%d,"tokens_hash":%d}'
    with open(path, "w") as f:
        step = 4096
        event_ids = [0] * workers
        for start in range(0, chains, step):
            n = min(step, chains - start)
            seq = rng.integers(0, 2**64, size=(n, uniq), dtype=np.uint64).tolist()
            loc = rng.integers(0, 2**64, size=(n, uniq), dtype=np.uint64).tolist()
            lines = []
            for k in range(n):
                c = start + k
                w = c % workers
                p = (c // workers) % shared_prefixes   # every prefix on every worker
                s_all = pre_seq[p].tolist() + seq[k]
                l_all = pre_loc[p].tolist() + loc[k]
                event_ids[w] += 1
                body = ",".join([block_fmt % bl for bl in zip(s_all, l_all)])
                lines.append(
                    '{"worker_id":%d,"storage_tier":"device","event":{"event_id":%d,"data":'
                    '{"stored":{"parent_hash":null,"blocks":[%s]}},"dp_rank":0}}\n'
                    % (1000 + w, event_ids[w], body))
            f.write("".join(lines))


# --------------------------------------------------------------------------------------------
# child processes
# --------------------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _queries(lines: list[str], max_queries: int) -> list[list[int]]:
    """Local-hash lists of stored events that start at the root (parent null)."""
    out = []
    for line in lines:
        if '"parent_hash":null' in line:
            obj = json.loads(line)
            out.append([b["tokens_hash"] for b in obj["event"]["data"]["stored"]["blocks"]])
            if len(out) >= max_queries:
                break
    return out


def child(side: str, path: str, max_queries: int) -> dict:
    with open(path) as f:
        lines = f.read().splitlines()
    queries = _queries(lines, max_queries)
    blocks = sum(line.count('"block_hash"') for line in lines)
    if side == "peer":
        from dynamo._core import RadixTree

        ids: dict[tuple[int, str], int] = {}
        items = []
        for line in lines:
            i = line.index(',"event":')
            head = json.loads(line[:i] + "}")
            key = (head["worker_id"], head.get("storage_tier", "device"))
            wid = ids.setdefault(key, len(ids))
            items.append((wid, line[i + 9:-1].encode()))
        del lines
        gc.collect()
        rss0 = _rss()
        tree = RadixTree()
        apply = tree.apply_event
        t0 = time.perf_counter()
        for wid, data in items:
            apply(wid, data)
        t1 = time.perf_counter()
        gc.collect()
        rss1 = _rss()
        find = tree.find_matches
        q0 = time.perf_counter()
        for q in queries:
            find(q).scores          # the answer as Python objects, as match_local returns it
        q1 = time.perf_counter()
        for q in queries:
            find(q)                 # the Rust object only (scores not read)
        extra = {"query_bare_s": time.perf_counter() - q1}
        events = len(items)
    else:
        sys.path.insert(0, str(ROOT / "src"))
        from kvstrata.events.indexer import PrefixIndex
        from kvstrata.events.subscriber import StreamFollower, decode_line

        gc.collect()
        rss0 = _rss()
        index = PrefixIndex(native=None if side == "ours" else False)
        follower = StreamFollower(index, snapshots=False)
        feed = follower.feed
        t0 = time.perf_counter()
        for line in lines:
            wid, pid, event = decode_line(line, "dynamo")
            feed(wid, pid, (event,))
        t1 = time.perf_counter()
        assert follower.gaps == 0 and follower.applied == len(lines)
        gc.collect()
        rss1 = _rss()
        match = index.match_local
        q0 = time.perf_counter()
        for q in queries:
            match(q)
        q1 = time.perf_counter()
        events = len(lines)
        extra = {}
    return {**extra,
        "side": side, "events": events, "blocks": blocks,
        "ingest_s": t1 - t0, "query_s": q1 - q0, "queries": len(queries),
        "rss_bytes": rss1 - rss0,
    }


def run_child(side: str, path: Path, max_queries: int) -> dict | None:
    python = str(PEER_PYTHON) if side == "peer" else sys.executable
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [python, __file__, "--child", side, "--file", str(path), "--queries", str(max_queries)],
        capture_output=True, text=True, env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        print(f"  {side} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# parent
# --------------------------------------------------------------------------------------------


def _fmt(r: dict) -> str:
    return (f"ingest {r['events'] / r['ingest_s'] / 1e3:8.1f} K events/s "
            f"{r['blocks'] / r['ingest_s'] / 1e6:6.2f} M blocks/s   "
            f"query {r['queries'] / r['query_s'] / 1e3:7.1f} K/s   "
            f"{r['rss_bytes'] / r['blocks']:6.0f} B/block")


def compare(name: str, path: Path, sides: list[str], repeats: int, max_queries: int) -> None:
    print(f"== {name}: {path.stat().st_size / 1e6:.0f} MB of RouterEvent lines")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for rep in range(repeats):
        for side in sides:
            r = run_child(side, path, max_queries)
            if r is None:
                continue
            runs[side].append(r)
            print(f"  run {rep + 1} {side:6s} {_fmt(r)}", flush=True)
    best = {}
    for side, rs in runs.items():
        if rs:
            best[side] = {
                "ingest": max(r["events"] / r["ingest_s"] for r in rs),
                "blocks": max(r["blocks"] / r["ingest_s"] for r in rs),
                "query": max(r["queries"] / r["query_s"] for r in rs),
                "bytes": min(r["rss_bytes"] / r["blocks"] for r in rs),
                "query_bare": max((r["queries"] / r["query_bare_s"] for r in rs if "query_bare_s" in r), default=0),
            }
    if "peer" not in best:
        print("  (peer skipped: no result)")
        for side in best:
            b = best[side]
            print(f"  best {side}: {b['ingest']:,.0f} events/s, {b['query']:,.0f} queries/s, {b['bytes']:.0f} B/block")
        return
    p = best["peer"]
    for side in [s for s in best if s != "peer"]:
        o = best[side]
        tag = f"indexer_{name}" + ("" if side == "ours" else f"_{side}")
        print(f"RESULT name={tag}_ingest ours={o['ingest']:,.0f}ev/s baseline={p['ingest']:,.0f}ev/s "
              f"ratio={o['ingest'] / p['ingest']:.2f} blocks_ours={o['blocks'] / 1e6:.2f}M/s "
              f"blocks_peer={p['blocks'] / 1e6:.2f}M/s goal=>=1")
        print(f"RESULT name={tag}_query ours={o['query']:,.0f}q/s baseline={p['query']:,.0f}q/s "
              f"ratio={o['query'] / p['query']:.2f} goal=>=1 (peer: find_matches(q).scores; "
              f"without reading .scores {p['query_bare']:,.0f}q/s, ratio {o['query'] / p['query_bare']:.2f})")
        print(f"RESULT name={tag}_memory ours={o['bytes']:.0f}B/block baseline={p['bytes']:.0f}B/block "
              f"ratio={o['bytes'] / p['bytes']:.2f} goal=<=1.5")
        pairs = [(a, b) for a, b in zip(runs[side], runs["peer"])]
        if len(pairs) > 1:
            ing = [(a["events"] / a["ingest_s"]) / (b["events"] / b["ingest_s"]) for a, b in pairs]
            qry = [(a["queries"] / a["query_s"]) / (b["queries"] / b["query_s"]) for a, b in pairs]
            bare = [(a["queries"] / a["query_s"]) / (b["queries"] / b["query_bare_s"]) for a, b in pairs]
            print(f"  same-run pair ratios ({side}/peer): ingest {min(ing):.2f}-{max(ing):.2f}, "
                  f"query {min(qry):.2f}-{max(qry):.2f} (vs bare find_matches {min(bare):.2f}-{max(bare):.2f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: trace limited, 200 K blocks at scale")
    ap.add_argument("--workload", choices=("trace", "scale", "both"), default="both")
    ap.add_argument("--blocks", type=int, default=1_000_000, help="stored blocks of the scale workload")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--queries", type=int, default=20_000)
    ap.add_argument("--python-core", action="store_true", help="also run kvstrata's pure-Python core")
    ap.add_argument("--dir", help="keep the event files here (reused when present)")
    ap.add_argument("--child", choices=("ours", "python", "peer"), help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.file, args.queries)))
        return 0
    sides = ["ours"] + (["python"] if args.python_core else [])
    if PEER_PYTHON.exists():
        sides.append("peer")
    else:
        print(f"peer skipped: {PEER_PYTHON} not found (run scripts/setup_peers.sh)")
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-indexer-") as tmp:
        d = Path(args.dir) if args.dir else Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        if args.workload in ("trace", "both"):
            limit = 2000 if args.quick else None
            path = d / f"trace-{limit or 'all'}.jsonl"
            if not path.exists():
                t = time.perf_counter()
                write_trace_events(path, limit)
                print(f"(trace events written in {time.perf_counter() - t:.1f} s)")
            compare("trace", path, sides, args.repeats, args.queries)
        if args.workload in ("scale", "both"):
            blocks = 200_000 if args.quick else args.blocks
            path = d / f"scale2-{blocks}.jsonl"
            if not path.exists():
                t = time.perf_counter()
                write_scale_events(path, blocks)
                print(f"(scale events written in {time.perf_counter() - t:.1f} s)")
            compare(f"scale_{blocks // 1_000_000 or blocks / 1e6:g}M".replace(".", "_"), path, sides,
                    args.repeats, args.queries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
