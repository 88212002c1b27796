"""RSS of a long ``vllm serve`` run with kvstrata as the KV connector, beside the NullConnector.

Issue 24: the transfer engine used to keep every ``TransferResult`` for the server's life (a
``completions`` queue the vLLM worker never drained). This bench runs one server at a time
on 127.0.0.1 and sends it many multi-turn requests over HTTP, sampling the resident memory
(``VmRSS``) of the server's whole process tree (the API server, the EngineCore and any other
child) every ``--sample-every`` requests:

* ``kvstrata`` -- ``KvStrataConnector`` with a small G2 (host RAM) over a G3 (disk): the
  blocks of every prompt are stored G1 -> G2 -> G3 and returning prefixes load back from G2
  or G3 (vLLM's own KV cache is kept small with ``--num-gpu-blocks-override``, so a
  conversation's prefix has left it by the time the conversation returns);
* ``null`` -- ``NullConnector`` (:mod:`kvstrata.testing.null_connector`): loads and stores
  nothing. The same load against it shows how much vLLM itself grows, so kvstrata's growth is
  read beside it, not against zero.

Workload (seeded; the same token ids for both servers, up to the model's answers):
``--conversations`` conversations played round robin by ``--concurrency`` client threads. A
conversation's first prompt is ``--first`` random token ids; every later turn is the
previous prompt + the model's answer (``--answer`` tokens, ``return_token_ids``) + 32..96 new
user tokens; past ``--max-context`` tokens the conversation starts over with a new first
prompt. So every request after a conversation's first returns
with a prefix that kvstrata stored.

Reported per server: a table of RSS (MiB) per process and in total every ``--sample-every``
requests, then the growth from the first sample at or after ``--warmup`` requests (G2 filled,
caches warm) to the end, in MiB and in MiB per 1,000 requests; kvstrata's counters from
vLLM's ``/metrics`` and the prompt tokens served from cache (``cached_tokens``) show the work
happened. Prints figures, asserts nothing. Usage::

    python bench/bench_serve_rss.py [--quick] [--requests N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvstrata.testing.serve import NULL_CONNECTOR, VllmServer, http, kvstrata_connector

BLOCK_SIZE = 32            # CPU build: a multiple of 32
SERVERS = ("kvstrata", "null")
START_TIMEOUT = 300        # s for a server to answer /health


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- memory of a process tree --------------------------------------------------------------
def _children(pid: int) -> list[int]:
    """Descendants of ``pid`` (psutil if installed, else /proc)."""
    try:
        import psutil

        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except ImportError:
        pass
    except Exception:
        return []
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _status(pid: int) -> tuple[str, dict[str, int]] | None:
    """(name, {VmRSS, RssAnon, RssFile, RssShmem} in bytes) from /proc/<pid>/status; None
    if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    name = re.search(r"^Name:\s*(.*)$", text, re.M)
    sizes = {key: int(m.group(1)) * 1024 if (m := re.search(rf"^{key}:\s*(\d+) kB", text,
                                                              re.M)) else 0
             for key in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
    return (name.group(1).strip() if name else "?"), sizes


def _role(pid: int, root: int, name: str) -> str:
    if pid == root:
        return "api"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmdline = ""
    for role, marker in (("engine", "EngineCore"), ("worker", "Worker")):
        if marker in name or marker in cmdline:
            return role
    return "other"


def tree_rss(root: int) -> dict[str, int]:
    """VmRSS (bytes) of the process tree under ``root``, by role: ``api`` (the root, vLLM's
    API server), ``engine`` (EngineCore: vLLM's scheduler, kvstrata's scheduler half),
    ``worker`` (the model runner: vLLM's KV cache, kvstrata's worker half with G2 and the
    transfer engine), ``other`` (anything else, e.g. multiprocessing's resource tracker);
    and ``total``; ``<role>_anon`` / ``<role>_file`` / ``<role>_shmem`` split each
    (RssAnon: the heap; RssFile: mapped files; RssShmem: shared memory)."""
    roles = ("api", "engine", "worker", "other")
    out = dict.fromkeys(roles, 0)
    for role in roles:
        out.update({f"{role}_anon": 0, f"{role}_file": 0, f"{role}_shmem": 0})
    for pid in [root, *_children(root)]:
        got = _status(pid)
        if got is not None:
            role = _role(pid, root, got[0])
            out[role] += got[1]["VmRSS"]
            out[f"{role}_anon"] += got[1]["RssAnon"]
            out[f"{role}_file"] += got[1]["RssFile"]
            out[f"{role}_shmem"] += got[1]["RssShmem"]
    out["total"] = sum(out[r] for r in roles)
    return out


# -- the server ----------------------------------------------------------------------------
def kv_transfer_config(name: str, work: Path, args: argparse.Namespace) -> dict:
    if name == "null":
        return NULL_CONNECTOR
    tiers = {"G2": {"bytes": args.g2}, "G3": {"bytes": args.g3}}
    return kvstrata_connector({"tiers": tiers, "disk_dir": str(work / "g3"),
                               "cost_aware": args.cost_aware,
                               **json.loads(args.connector_extra)})


class Server(VllmServer):
    """One ``vllm serve`` (:class:`kvstrata.testing.serve.VllmServer`) of the bench's
    geometry, named for the table, that reads kvstrata's counters from ``/metrics``."""

    def __init__(self, name: str, model: Path, work: Path, args: argparse.Namespace) -> None:
        self.name = name
        (work / "g3").mkdir(exist_ok=True)
        super().__init__(model, kv_transfer_config(name, work, args), work / f"{name}.log",
                         name="m", block_size=BLOCK_SIZE,
                         max_model_len=args.max_context + args.answer + 256,
                         args=["--num-gpu-blocks-override", str(args.gpu_blocks),
                               "--uvicorn-log-level", "warning"],
                         env={"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)})

    def metrics(self) -> dict[str, float]:
        """kvstrata's counters and vLLM's prefix-cache counters from /metrics (summed over
        label sets but the tier, which is kept in the key)."""
        out: dict[str, float] = {}
        try:
            text = http(self.base + "/metrics", timeout=30).decode()
        except OSError as exc:
            return {"error": repr(exc)}
        for line in text.splitlines():
            if line.startswith("#") or not ("kvstrata" in line or "prefix_cache" in line):
                continue
            m = re.match(r"vllm:(\w+?)(?:_total)?(\{[^}]*\})? ([0-9.eE+-]+)$", line)
            if not m or m.group(1).endswith("_created"):
                continue
            tier = re.search(r'tier="([^"]+)"', m.group(2) or "")
            key = m.group(1) + (f"{{{tier.group(1)}}}" if tier else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
        return out


# -- the workload --------------------------------------------------------------------------
class Conversations:
    """``n`` endless conversations (see the module docstring), handed out round robin."""

    def __init__(self, n: int, args: argparse.Namespace, vocab: int) -> None:
        # one generator per conversation: its token ids do not depend on the order in which
        # the clients' requests complete
        self.rngs = [random.Random(args.seed * 1_000_003 + i) for i in range(n)]
        self.args = args
        self.vocab = vocab
        self.prompts = [self._first(i) for i in range(n)]
        self.busy = [False] * n
        self.next = 0
        self.lock = threading.Lock()

    def _ids(self, i: int, k: int) -> list[int]:
        rng = self.rngs[i]
        return [rng.randrange(3, self.vocab) for _ in range(k)]

    def take(self) -> tuple[int, list[int]]:
        """The next idle conversation and its prompt (its previous turn must be answered)."""
        with self.lock:
            n = len(self.prompts)
            for _ in range(n):
                i, self.next = self.next, (self.next + 1) % n
                if not self.busy[i]:
                    self.busy[i] = True
                    return i, self.prompts[i]
        raise RuntimeError("more client threads than conversations")

    def answered(self, i: int, prompt: list[int], answer: list[int]) -> None:
        with self.lock:
            nxt = prompt + answer + self._ids(i, self.rngs[i].randint(32, 96))
            self.prompts[i] = nxt if len(nxt) <= self.args.max_context else self._first(i)
            self.busy[i] = False

    def _first(self, i: int) -> list[int]:
        return self._ids(i, self.args.first)


def run_load(server: Server, args: argparse.Namespace, vocab: int) -> dict:
    """Send ``args.requests`` requests; sample RSS every ``args.sample_every``."""
    convs = Conversations(args.conversations, args, vocab)
    lock = threading.Lock()
    done = 0
    cached = prompt_tokens = 0
    errors: list[str] = []
    samples: list[dict] = []
    claimed = 0                # requests being sent now
    next_sample = args.sample_every
    started = time.perf_counter()

    def sample(n: int) -> None:
        row = {"requests": n, "seconds": round(time.perf_counter() - started, 1),
               **{k: v / 2**20 for k, v in tree_rss(server.proc.pid).items()}}
        samples.append(row)
        print(f"{server.name:>9} {n:>8} {row['seconds']:>7.0f} {row['api']:>8.1f} "
              f"{row['engine']:>8.1f} {row['worker']:>8.1f} {row['other']:>7.1f} "
              f"{row['total']:>8.1f}", flush=True)

    def client() -> None:
        nonlocal done, cached, prompt_tokens, next_sample, claimed
        while True:
            with lock:
                if done + claimed >= args.requests or errors:
                    return
                claimed += 1
            i, prompt = convs.take()
            body = {"model": "m", "prompt": prompt, "max_tokens": args.answer,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            try:
                out = json.loads(http(server.base + "/v1/completions", body))
                answer = list(out["choices"][0].get("token_ids") or [])
                usage = out.get("usage") or {}
                hit = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            except Exception as exc:                 # reported; the run stops
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    claimed -= 1
                return
            convs.answered(i, prompt, answer)
            with lock:
                claimed -= 1
                done += 1
                cached += hit
                prompt_tokens += len(prompt)
                due = done >= next_sample
                if due:
                    next_sample += args.sample_every
                    sample(done)

    sample(0)                  # the server idle, before the first request
    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{server.name}: request failed: {errors[0]}\n{server.log_tail()}")
    if samples[-1]["requests"] != done:
        sample(done)
    wall = time.perf_counter() - started
    return {"requests": done, "seconds": wall, "samples": samples,
            "prompt_tokens": prompt_tokens, "cached_tokens": cached}


def growth(samples: list[dict], warmup: int) -> dict:
    """RSS growth from the first sample at or after ``warmup`` requests to the last."""
    first = next((s for s in samples if s["requests"] >= warmup), samples[0])
    last = samples[-1]
    n = last["requests"] - first["requests"]
    out = {"from_requests": first["requests"], "to_requests": last["requests"]}
    for key in [k for k in last if k not in ("requests", "seconds")]:
        mib = last[key] - first[key]
        out[f"{key}_mib"] = mib
        out[f"{key}_mib_per_1k"] = mib / n * 1000 if n else 0.0
    out["start_total_mib"], out["end_total_mib"] = first["total"], last["total"]
    return out


def run_server(name: str, model: Path, work: Path, args: argparse.Namespace,
               vocab: int) -> dict:
    say(f"{name}: starting vllm serve")
    started = time.perf_counter()
    server = Server(name, model, work, args)
    try:
        server.wait_healthy(START_TIMEOUT)
        say(f"{name}: healthy after {time.perf_counter() - started:.0f} s; "
            f"{args.requests} requests, {args.concurrency} clients")
        print(f"{'RSS MiB':>9} {'requests':>8} {'s':>7} {'api':>8} {'engine':>8} "
              f"{'worker':>8} {'other':>7} {'total':>8}", flush=True)
        result = run_load(server, args, vocab)
        time.sleep(1.0)                     # the last steps' stats reach the logger
        result["metrics"] = server.metrics()
    finally:
        server.stop()
        shutil.rmtree(work / "g3", ignore_errors=True)
    result["growth"] = growth(result["samples"], args.warmup)
    g = result["growth"]
    say(f"{name}: {result['requests']} requests in {result['seconds']:.0f} s; "
        f"RSS {g['start_total_mib']:.0f} -> {g['end_total_mib']:.0f} MiB from request "
        f"{g['from_requests']} to {g['to_requests']} ({g['total_mib']:+.1f} MiB, "
        f"{g['total_mib_per_1k']:+.2f} MiB per 1,000 requests)")
    return result


def report(results: dict[str, dict], args: argparse.Namespace, wall: float) -> None:
    print()
    print(f"RSS growth after warm-up ({args.warmup} requests), MiB; "
          f"per 1,000 requests in brackets")
    print(f"{'server':>9} {'requests':>9} {'req/s':>6} {'start':>8} {'end':>8} "
          f"{'api':>15} {'engine':>15} {'worker':>15} {'total':>15}")
    for name, r in results.items():
        g = r["growth"]
        cells = " ".join(f"{g[f'{k}_mib']:+6.1f} ({g[f'{k}_mib_per_1k']:+5.2f})"
                         for k in ("api", "engine", "worker", "total"))
        print(f"{name:>9} {g['from_requests']:>4}-{g['to_requests']:<4} "
              f"{r['requests'] / r['seconds']:>6.1f} {g['start_total_mib']:>8.1f} "
              f"{g['end_total_mib']:>8.1f} {cells}")
    print()
    for name, r in results.items():
        g = r["growth"]
        print(f"{name}: worker growth by kind of page: heap (RssAnon) "
              f"{g['worker_anon_mib']:+.1f} MiB, mapped files (RssFile) "
              f"{g['worker_file_mib']:+.1f} MiB, shared memory (RssShmem) "
              f"{g['worker_shmem_mib']:+.1f} MiB")
    for name, r in results.items():
        share = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
        m = r.get("metrics", {})
        work = ", ".join(f"{k}={v:,.0f}" for k, v in sorted(m.items())
                         if k.startswith(("kvstrata_blocks", "kvstrata_tokens_matched")))
        print(f"{name}: prompt tokens served from cache {r['cached_tokens']:,} of "
              f"{r['prompt_tokens']:,} ({share:.0%})" + (f"; {work}" if work else ""))
    print(f"total run time {wall:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run: 300 requests")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per server (default 4000, --quick 300)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="requests before the growth is measured (default 20%%)")
    parser.add_argument("--sample-every", type=int, default=None,
                        help="requests between RSS samples (default requests / 20)")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated, in order, from {','.join(SERVERS)}")
    parser.add_argument("--conversations", type=int, default=16,
                        help="conversations played round robin")
    parser.add_argument("--concurrency", type=int, default=2, help="client threads")
    parser.add_argument("--first", type=int, default=384, help="tokens of a first turn")
    parser.add_argument("--answer", type=int, default=8, help="tokens of each answer")
    parser.add_argument("--max-context", type=int, default=1536,
                        help="a conversation longer than this starts over")
    parser.add_argument("--gpu-blocks", type=int, default=160,
                        help="vLLM's own KV cache in blocks (--num-gpu-blocks-override): "
                             "smaller than the conversations, so returning prefixes left it")
    parser.add_argument("--g2", default="8MiB", help="kvstrata's G2 (host RAM)")
    parser.add_argument("--g3", default="256MiB", help="kvstrata's G3 (disk)")
    parser.add_argument("--cost-aware", action="store_true",
                        help="leave kvstrata's cost model on (off by default: the tiny model "
                             "recomputes a prefix faster than it loads, so the model would "
                             "rightly load nothing, and this bench is about loads and stores)")
    parser.add_argument("--connector-extra", default="{}", metavar="JSON",
                        help='more of kvstrata\'s kv_connector_extra_config, e.g. '
                             '\'{"load": false}\' (stores only)')
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--model", choices=("tiny", "bench"), default="tiny",
                        help="the random Llama (kvstrata.testing.random_model)")
    parser.add_argument("--model-dir", default=None,
                        help="where the model is made/reused (default "
                             "~/.cache/kvstrata/models/<model>)")
    parser.add_argument("--work-dir", default=None,
                        help="server logs and G3 (default: a temp dir, removed at the end)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token ids")
    parser.add_argument("--json", default=None, help="write the raw numbers to this file")
    args = parser.parse_args()
    args.requests = args.requests or (300 if args.quick else 4000)
    args.warmup = args.warmup if args.warmup is not None else args.requests // 5
    args.sample_every = args.sample_every or max(1, args.requests // 20)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if set(names) - set(SERVERS) or not names:
        parser.error(f"--servers: from {', '.join(SERVERS)}")
    if args.concurrency > args.conversations:
        parser.error("--concurrency must not exceed --conversations")

    from kvstrata.testing.random_model import BENCH, TINY, make_random_llama

    shape = {"tiny": TINY, "bench": BENCH}[args.model]
    model_dir = args.model_dir or os.path.expanduser(f"~/.cache/kvstrata/models/{args.model}")
    model = make_random_llama(model_dir, shape)
    temp = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="kvstrata-bench-rss-") if temp else args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    say(f"{args.requests} requests per server, {args.conversations} conversations, "
        f"{args.concurrency} clients, first turn {args.first} tokens, answers {args.answer}, "
        f"context up to {args.max_context}; vLLM KV {args.gpu_blocks} blocks of {BLOCK_SIZE}; "
        f"kvstrata G2 {args.g2}, G3 {args.g3}; model {args.model}; work dir {work}")
    started = time.perf_counter()
    results: dict[str, dict] = {}
    try:
        for name in names:
            results[name] = run_server(name, model, work, args, shape.vocab_size)
    finally:
        if temp:                # a failure already printed the server's log tail
            shutil.rmtree(work, ignore_errors=True)
    wall = time.perf_counter() - started
    report(results, args, wall)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "results": results, "wall_s": wall}, indent=1))


if __name__ == "__main__":
    main()
