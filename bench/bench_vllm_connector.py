"""Time to first token of returning turns in a real vLLM engine, per KV connector.

Workload: a few multi-turn conversations (seeded random token ids; first turn ~1,500 tokens,
each later turn = the previous prompt + the model's greedy answer + 200-300 new user tokens,
so late turns pass 2.5K tokens), played interleaved (turn 1 of A, turn 1 of B, ..., turn 2 of
A, ...), so several conversations are cached at once. Before every turn vLLM's own prefix
cache is emptied (``llm.reset_prefix_cache()``: the conversation was evicted from device
memory) and the turn's prompt runs alone with ``max_tokens=1``; the wall time of that
``generate`` call is the turn's TTFT. The answer (``--answer`` tokens) is then generated in a
separate call, which is not timed.

Configurations, each with its own engine in its own subprocess (one cannot warm or slow
another), all measured in the same run:

* ``floor`` -- NullConnector, vLLM's cache *kept* between turns: the best any connector can do;
* ``null`` -- NullConnector, cache emptied: every turn recomputed (the recompute baseline);
* ``kvstrata-g2`` -- KvStrataConnector with a G2 host tier only: returning turns load from RAM;
* ``kvstrata-g3`` -- KvStrataConnector with a small G2 over a G3 disk tier: G2 holds one
  conversation (every block a step stores must find a G2 slot: vLLM's blocks cannot wait, so
  a surplus is skipped) but not the others played between two of its turns, so by the time
  a turn returns its blocks left G2 and load from disk (the table says from which tier);
* ``example`` -- vLLM's ExampleConnector (safetensors files per prompt): matches whole prompts
  only, so a returning turn, whose prompt is new, finds nothing.

Not run unless named: ``kvstrata-g3-tiny``, a G2 of a few MiB (fewer blocks than one turn):
G2 takes only what fits each step, so G3 receives a few blocks of each turn and a returning
turn loads little.

Why the null connector is the baseline and not plain vLLM: on vLLM's CPU build configuring
*any* KV connector changes how prefill runs (about 1.8x faster than with no connector), so
plain vLLM would flatter every connector. The null connector gets that same prefill and loads
and stores nothing: the gap to it is what loading buys, the gap to ``floor`` what it costs.

The machine may be shared: a configuration during which other processes used more than
20 % of the CPU is run again (``--noise-retries``) and the quietest run kept.

``--arch`` picks the model: ``llama`` (default; full attention), ``gemma3`` (sliding-window
layers with a window of ``--window`` tokens, shorter than every turn, and one full-attention
layer in four: vLLM's hybrid KV cache manager on, four KV cache groups), ``deepseek_v2``
(MLA; on vLLM's CPU build, which cannot attend to a cached MLA prefix, kvstrata stores and
loads nothing: every turn is a recompute there, and the table shows it), ``qwen3_next``
(linear-attention layers, a Mamba-style state group, beside full attention). Block size: 32,
MLA's 16 on a CPU; with a Mamba state vLLM's choice.

Goals: kvstrata's returning turns within 1.5x the floor from G2 and 2x from G3; its cold
first turns (storing in the background) within 1.10x of the null connector's. Correctness:
the greedy tokens of every turn (first token and answer) are compared across configurations
and grouped; floor and kvstrata attend to the same KV bytes and must agree bit for bit, while
recomputing the prefix (null, example) may flip a near-tie token in bf16. kvstrata's
``num_cached_tokens`` (tokens it loaded, vLLM's own cache being empty) should cover every full
block of the previous turn. Prints figures, never asserts timing. Usage:
``python bench/bench_vllm_connector.py [--quick] [--configs floor,null,...] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import result_line

CONFIGS = ("floor", "null", "kvstrata-g2", "kvstrata-g3", "example")
EXTRA_CONFIGS = ("kvstrata-g3-tiny",)   # G2 of --g2-tiny: shows stores dropped (see --help)
GOAL_G2 = 1.5           # returning TTFT from G2 <= 1.5x the floor
GOAL_G3 = 2.0           # returning TTFT from G3 <= 2x the floor
GOAL_COLD = 1.10        # cold TTFT <= 1.10x the null connector's
BLOCK_SIZES = {"llama": 32, "gemma3": 32, "deepseek_v2": 16, "qwen3_next": None}
"""vLLM's CPU build: attention blocks a multiple of 32; its MLA kernel needs 16; with a
Mamba state vLLM picks one (an attention page at least as large as the state's)."""
BLOCK_SIZE = 32         # of --arch: set by main() (and in each child from its spec)
VOCAB = 8192            # BENCH model; ids 0, 1, 2 (unk, bos, eos) avoided
CHILD_TIMEOUT = 420     # s per configuration (engine start included)
NOISY = 0.20            # share of all cores other processes used: a run is rerun above it


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- the workload -------------------------------------------------------------------------
def make_workload(seed: int, conversations: int, turns: int, first: int) -> dict:
    """Token ids of every conversation's first turn and of each later turn's user message
    (the answers come from the model at run time), plus a warm-up prompt."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]
    convs = [{"first": ids(first),
              "user": [ids(rng.randint(200, 300)) for _ in range(turns - 1)]}
             for _ in range(conversations)]
    return {"seed": seed, "turns": turns, "conversations": convs, "warmup": ids(first)}


def kv_transfer_config(name: str, work: Path, args: argparse.Namespace) -> dict:
    if name in ("floor", "null"):
        return {"kv_connector": "NullConnector",
                "kv_connector_module_path": "kvstrata.testing.null_connector",
                "kv_role": "kv_both"}
    if name.startswith("kvstrata"):
        g2 = {"kvstrata-g2": args.g2, "kvstrata-g3": args.g2_small,
              "kvstrata-g3-tiny": args.g2_tiny}[name]
        tiers = {"G2": {"bytes": g2}}
        if name != "kvstrata-g2":
            tiers["G3"] = {"bytes": args.g3, "path": str(work / "g3")}
        return {"kv_connector": "KvStrataConnector",
                "kv_connector_module_path": "kvstrata.connectors.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": {"tiers": tiers}}
    if name == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(work / "example")}}
    raise ValueError(name)


# -- one configuration (child process) ------------------------------------------------------
def reset_prefix_cache(llm, timeout: float = 60.0) -> tuple[int, float]:
    """Empty vLLM's prefix cache; blocks a connector still stores from are freed a little
    later, so retry until it works. Returns (attempts, seconds waited)."""
    start = time.perf_counter()
    attempts = 0
    while True:
        attempts += 1
        if llm.reset_prefix_cache():
            return attempts, time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"reset_prefix_cache() still failing after {timeout:.0f} s")
        time.sleep(0.02)


def connector_metrics(llm) -> dict:
    """kvstrata's counters and vLLM's prefix-cache counters, from vLLM's metrics."""
    out: dict[str, float] = {}
    try:
        for m in llm.get_metrics():
            if ("kvstrata" in m.name or "prefix_cache" in m.name) and hasattr(m, "value"):
                tier = m.labels.get("tier")
                key = m.name.removeprefix("vllm:") + (f"{{{tier}}}" if tier else "")
                out[key] = out.get(key, 0) + m.value
    except Exception as exc:            # metrics are a diagnostic, never the figure
        out["error"] = repr(exc)
    return out


def tree_cpu_seconds() -> float | None:
    """CPU seconds used so far by this process and its descendants (the engine's)."""
    try:
        import psutil

        me = psutil.Process()
        total = 0.0
        for p in [me, *me.children(recursive=True)]:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        return total
    except Exception:
        return None


def tree_pids() -> list[int]:
    """This process and its descendants (the engine's processes), for a scheduler trace."""
    try:
        import psutil

        me = psutil.Process()
        return [me.pid, *(p.pid for p in me.children(recursive=True))]
    except Exception:
        return [os.getpid()]


STANDIN_PIDS = "KVSTRATA_BENCH_STANDIN_PIDS"
"""Environment variable: pids of processes that stand for a remote service (a bench's object
store, its slow link), whose CPU each turn's accounting shows apart (``turn_cpu``)."""


def pids_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds used so far by the processes ``pids`` (all their threads); gone: 0."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
    return total


class TurnCpu:
    """Where the machine's CPU went while one turn ran: this engine's processes, the stand-in
    services (:data:`STANDIN_PIDS`), and everything else (other users of a shared machine).
    A turn slower than its same-run counterpart while others took more CPU says more about
    the machine than about the connector. Clock-tick resolution (10 ms)."""

    def __init__(self) -> None:
        self.standins = [int(x) for x in os.environ.get(STANDIN_PIDS, "").split(",") if x]

    def sample(self) -> tuple[float, float, float]:
        return busy_cpu_seconds(), tree_cpu_seconds() or 0.0, \
            pids_cpu_seconds(self.standins)

    @staticmethod
    def between(before: tuple[float, float, float], after: tuple[float, float, float],
                wall: float) -> dict:
        busy, own, standin = (b - a for a, b in zip(before, after))
        cores = os.cpu_count() or 1
        return {"own_s": own, "standin_s": standin, "others_s": max(0.0, busy - own - standin),
                "others_share": max(0.0, busy - own - standin) / (wall * cores)}


def run_child(name: str, spec_path: str, out_path: str) -> None:
    global BLOCK_SIZE
    spec = json.loads(Path(spec_path).read_text())
    BLOCK_SIZE = spec["block_size"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kv_cache_gib"]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    sized = {"block_size": BLOCK_SIZE} if BLOCK_SIZE else {}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=8192, dtype="bfloat16", max_num_seqs=4,
              kv_transfer_config=spec["kv_transfer_config"], disable_log_stats=False, **sized)
    BLOCK_SIZE = llm.llm_engine.vllm_config.cache_config.block_size
    engine_s = time.perf_counter() - started
    say(f"{name}: engine up in {engine_s:.0f} s")
    first = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    answer = SamplingParams(max_tokens=spec["answer"], temperature=0, detokenize=False,
                            ignore_eos=True)
    reset = name != "floor"

    def run(tokens, params):
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        return time.perf_counter() - start, out

    warm = spec["workload"]["warmup"]               # warm-up: cold and prefix-hit prefills
    run(warm, first)
    run(warm, answer)
    run(warm + warm[:250], first)
    reset_prefix_cache(llm)
    accounting = TurnCpu()
    work = spec["workload"]
    prompts = [c["first"] for c in work["conversations"]]
    prev_total = [0] * len(prompts)
    turns = []
    for t in range(work["turns"]):
        for c, conv in enumerate(work["conversations"]):
            tries, waited = reset_prefix_cache(llm) if reset else (0, 0.0)
            before = accounting.sample()
            started_at = time.monotonic()
            ttft, out = run(prompts[c], first)
            cpu = accounting.between(before, accounting.sample(), ttft)
            cpu["monotonic"] = (started_at, started_at + ttft)    # for a scheduler trace
            _, ans = run(prompts[c], answer)
            tokens = list(ans.outputs[0].token_ids)
            # full blocks the previous turn computed (its last answer token never was)
            reusable = ((prev_total[c] - 1) // BLOCK_SIZE) * BLOCK_SIZE if t else 0
            turns.append({"conv": c, "turn": t + 1, "prompt_len": len(prompts[c]),
                          "ttft_s": ttft, "first_token": out.outputs[0].token_ids[0],
                          "answer": tokens, "num_cached_tokens": out.num_cached_tokens,
                          "reusable_tokens": reusable, "reset_attempts": tries,
                          "reset_wait_s": waited, "turn_cpu": cpu})
            say(f"{name}: conv {c} turn {t + 1} ({len(prompts[c])} tokens): "
                f"TTFT {ttft * 1e3:,.0f} ms, cached {out.num_cached_tokens}/{reusable}, "
                f"other processes {cpu['others_share']:.0%} of the CPU")
            prev_total[c] = len(prompts[c]) + len(tokens)
            if t + 1 < work["turns"]:
                prompts[c] = prompts[c] + tokens + conv["user"][t]
    time.sleep(0.5)                                  # let the last stats reach the frontend
    Path(out_path).write_text(json.dumps({"config": name, "engine_start_s": engine_s,
                                          "turns": turns, "metrics": connector_metrics(llm),
                                          "cpu_s": tree_cpu_seconds(), "pids": tree_pids()}))
    say(f"{name}: done in {time.perf_counter() - started:.0f} s")


# -- the driver -----------------------------------------------------------------------------
def auto_g2_small(workload: dict, answer: int) -> str:
    """A G2 for ``kvstrata-g3``: the blocks of the longest conversation plus a few. Every
    block a step makes full must find a G2 slot in that step (vLLM may reuse its block, so
    kvstrata skips a surplus it cannot place: a G2 smaller than one turn stores only part of
    it, and G3 never sees the rest), while the other conversations played between two turns
    of one conversation push its blocks out of G2, so a returning turn loads from G3."""
    from kvstrata.testing.random_model import BENCH

    longest = max(len(c["first"]) + sum(len(u) + answer for u in c["user"]) + answer
                  for c in workload["conversations"])
    block = BLOCK_SIZE or 64          # --arch qwen3_next: vLLM picks it; an estimate
    blocks = -(-longest // block) + 4
    return f"{-(-blocks * block * BENCH.kv_bytes_per_token() // (1 << 20))}MiB"


def busy_cpu_seconds() -> float:
    """Seconds all CPUs together were busy since boot (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return float("nan")


def spawn(name: str, spec_path: Path, out_path: Path, log_path: Path) -> dict:
    """Run one configuration in a subprocess; its output goes to ``log_path``, the progress
    lines and anything that looks like an error also to stderr. Interrupted (Ctrl-C, or
    SIGTERM turned into an exception), it kills the engine's process group first."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", name,
           "--_spec", str(spec_path), "--_out", str(out_path)]
    issues = {"tracebacks": 0, "errors": 0, "kvstrata_warnings": 0, "reset_refused": 0}
    start = time.perf_counter()
    busy0, cpu0 = busy_cpu_seconds(), time.process_time()
    load0 = os.getloadavg()[0]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, env=env, start_new_session=True)
        timer = threading.Timer(CHILD_TIMEOUT, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                low = line.lower()
                if "Traceback" in line:
                    issues["tracebacks"] += 1
                if "ValueError: Tokenizer not available when `skip_tokenizer_init" in line:
                    issues["tracebacks"] -= 1           # vLLM's chat-renderer warm-up: benign
                if " ERROR " in line or line.startswith("ERROR"):
                    issues["errors"] += 1
                if "WARNING" in line and "kvstrata" in low:
                    issues["kvstrata_warnings"] += 1
                if "Failed to reset prefix cache" in line:
                    issues["reset_refused"] += 1
                    continue
                if line.startswith("[bench]") or " ERROR " in line or \
                        ("WARNING" in line and "kvstrata" in low):
                    sys.stderr.write(line)
        except BaseException:              # interrupted: the engine must not outlive the bench
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timer.cancel()
            raise
        rc = proc.wait()
        timer.cancel()
    wall = time.perf_counter() - start
    busy = busy_cpu_seconds() - busy0 - (time.process_time() - cpu0)
    result = json.loads(out_path.read_text()) if out_path.is_file() else {"config": name}
    if result.get("cpu_s") is not None:
        # CPU that processes other than this benchmark's used meanwhile (it slows us down)
        result["other_cpu_share"] = max(0.0, busy - result["cpu_s"]) / (
            wall * (os.cpu_count() or 1))
    result.update(rc=rc, wall_s=wall, log=str(log_path), issues=issues,
                  load=(load0, os.getloadavg()[0]))     # 1-min load average, before / after
    if rc != 0 or "turns" not in result:
        say(f"{name}: FAILED (exit {rc}); see {log_path}")
    return result


def run_configuration(name: str, spec_path: Path, out_path: Path, work: Path,
                      noise_retries: int, cleanup=None) -> dict:
    """Run one configuration; run it again (up to ``noise_retries`` times) while other
    processes used more than :data:`NOISY` of the CPU meanwhile, and keep the quietest run
    (the others under ``noisy_runs``). ``cleanup`` runs after every attempt."""
    noisy: list[dict] = []
    for attempt in range(noise_retries + 1):
        say(f"{name}: starting" + (" again" if attempt else ""))
        out_path.unlink(missing_ok=True)
        result = spawn(name, spec_path, out_path,
                       work / f"{name}{'.' + str(attempt) if attempt else ''}.log")
        if cleanup is not None:
            cleanup()
        share = result.get("other_cpu_share", 0.0)
        if share <= NOISY or not result.get("turns"):
            break
        noisy.append(result)
        say(f"{name}: other processes used {share:.0%} of the CPU meanwhile" +
            (": running it again" if attempt < noise_retries else ""))
    if noisy:
        runs = sorted([result, *noisy], key=lambda r: r.get("other_cpu_share", 0.0))
        result = dict(runs[0], noisy_runs=runs[1:])
    return result


def tidy_work_dir(work: Path, temp: bool, results: dict[str, dict]) -> None:
    """Remove a temporary work dir after a clean run; keep it (and say where) otherwise."""
    failed = any(r.get("rc") or not r.get("turns") for r in results.values())
    if temp and not failed:
        shutil.rmtree(work, ignore_errors=True)
    elif temp:
        print(f"logs kept in {work}")


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def summarize(results: dict[str, dict]) -> dict[str, dict]:
    rows = {}
    for name, r in results.items():
        turns = r.get("turns")
        if not turns:
            continue
        cold = [x["ttft_s"] for x in turns if x["turn"] == 1]
        back = [x for x in turns if x["turn"] > 1]
        matched = {k[len("kvstrata_tokens_matched{"):-1]: v
                   for k, v in r.get("metrics", {}).items()
                   if k.startswith("kvstrata_tokens_matched{") and v}
        rows[name] = {"cold_ms": median_ms(cold),
                      "return_ms": median_ms([x["ttft_s"] for x in back]),
                      "cached_mean": statistics.mean(x["num_cached_tokens"] or 0 for x in back)
                      if back else float("nan"),
                      "reusable_mean": statistics.mean(x["reusable_tokens"] for x in back)
                      if back else float("nan"),
                      "loaded_from": {t: v / sum(matched.values()) for t, v in matched.items()}}
    return rows


def output_groups(results: dict[str, dict]) -> list[list[str]]:
    """Configurations grouped by identical greedy tokens (first token and answer, every
    turn), largest group first."""
    groups: dict[tuple, list[str]] = {}
    for name, r in results.items():
        if r.get("turns"):
            key = tuple((x["conv"], x["turn"], x["first_token"], tuple(x["answer"]))
                        for x in sorted(r["turns"], key=lambda x: (x["conv"], x["turn"])))
            groups.setdefault(key, []).append(name)
    return sorted(groups.values(), key=len, reverse=True)


def compare_outputs(results: dict[str, dict], ref_name: str) -> dict[str, list[str]]:
    """Per configuration, the turns whose greedy tokens (first token, answer) differ from
    ``ref_name``'s; a conversation's later turns differ too once an answer did (their
    prompts hold it), so only its first differing turn is described."""
    done = {n: {(x["conv"], x["turn"]): x for x in r["turns"]}
            for n, r in results.items() if r.get("turns")}
    ref = done.get(ref_name, {})
    out: dict[str, list[str]] = {}
    for name, turns in done.items():
        if name == ref_name:
            continue
        diffs, seen = [], set()
        for key, x in sorted(turns.items()):
            want = ref.get(key)
            if want is None or (x["first_token"], x["answer"]) == (want["first_token"],
                                                                    want["answer"]):
                continue
            if key[0] in seen:
                diffs.append(f"conv {key[0]} turn {key[1]}")
                continue
            seen.add(key[0])
            at = next((i for i, (a, b) in enumerate(zip(x["answer"], want["answer"]))
                       if a != b), None)
            what = "first token" if x["first_token"] != want["first_token"] else \
                f"answer token #{at}: {x['answer'][at]} vs {want['answer'][at]}"
            diffs.append(f"conv {key[0]} turn {key[1]} ({what})")
        out[name] = diffs
    return out


def report(results: dict[str, dict], wall_s: float) -> None:
    rows = summarize(results)
    floor = rows.get("floor", {}).get("return_ms")
    null = rows.get("null", {})
    print(f"{'configuration':<16} {'cold TTFT':>10} {'return TTFT':>12} {'x floor':>8} "
          f"{'x recompute':>12} {'cached tokens':>14} {'of reusable':>11}  loaded from")
    for name in results:
        row = rows.get(name)
        if row is None:
            print(f"{name:<16} failed: see {results[name].get('log', '?')}")
            continue
        xf = row["return_ms"] / floor if floor else float("nan")
        xr = row["return_ms"] / null["return_ms"] if null else float("nan")
        share = row["cached_mean"] / row["reusable_mean"] if row["reusable_mean"] else 0.0
        source = " ".join(f"{t} {v:.0%}" for t, v in sorted(row["loaded_from"].items())) or \
            ("vLLM's cache" if name == "floor" else "-")
        print(f"{name:<16} {row['cold_ms']:>7,.0f} ms {row['return_ms']:>9,.0f} ms "
              f"{xf:>8.2f} {xr:>12.2f} {row['cached_mean']:>14,.0f} {share:>11.0%}  {source}")
    n_ret = sum(1 for x in next((r["turns"] for r in results.values() if r.get("turns")), [])
                if x["turn"] > 1)
    print(f"(medians: cold = first turns, return = {n_ret} returning turns per configuration; "
          f"cached tokens = mean num_cached_tokens of a returning turn run alone after "
          f"reset_prefix_cache(), i.e. tokens the connector loaded (floor: vLLM's own hits); "
          f"reusable = the full blocks of the previous turn)")

    compared = [n for n, r in results.items() if r.get("turns")]
    ref_name = "floor" if "floor" in compared else (compared[0] if compared else None)
    n_turns = len(results[ref_name]["turns"]) if ref_name else 0
    answer = len(results[ref_name]["turns"][0]["answer"]) if ref_name else 0
    groups = output_groups(results)
    print(f"greedy outputs identical across configurations: "
          f"{'yes' if len(groups) <= 1 else 'NO'} ({n_turns} turns each: first token and "
          f"{answer}-token answer; groups of identical outputs: "
          f"{' | '.join(', '.join(g) for g in groups)})")
    diffs = compare_outputs(results, ref_name) if ref_name else {}
    for name, d in diffs.items():
        if d:
            print(f"  {name} differs from {ref_name} on {len(d)}/{n_turns} turns: "
                  f"{'; '.join(d[:3])}{' ...' if len(d) > 3 else ''}")
    ours = [n for n in diffs if n.startswith("kvstrata")]
    if ref_name == "floor" and ours:
        # floor and a connector that loads the previous turn's KV attend to the same bytes;
        # recomputing them (null, example) may flip a near-tie greedy token in bf16
        print(f"kvstrata outputs identical to floor's (same KV reused): "
              f"{'yes' if not any(diffs[n] for n in ours) else 'NO'} ({', '.join(ours)})")

    for name, r in results.items():
        m = r.get("metrics") or {}
        kv = {k.removeprefix("kvstrata_"): int(v) for k, v in sorted(m.items())
              if k.startswith("kvstrata_") and v}
        if kv or "error" in m:
            print(f"{name} counters: {kv or m}")
    for name, r in results.items():
        issues = {k: v for k, v in r.get("issues", {}).items() if v}
        waits = [x["reset_wait_s"] for x in r.get("turns", ()) if x["reset_attempts"] > 1]
        if issues or waits or r.get("rc"):
            extra = f", reset_prefix_cache() retried before {len(waits)} turns (max wait " \
                    f"{max(waits):.2f} s)" if waits else ""
            print(f"{name}: exit {r.get('rc')}, log {r.get('log')}: {issues}{extra}")
    busy = {n: r["other_cpu_share"] for n, r in results.items()
            if r.get("other_cpu_share", 0) > NOISY}
    for name, r in results.items():
        if r.get("noisy_runs"):
            shares = ", ".join(f"{x.get('other_cpu_share', 0):.0%}" for x in r["noisy_runs"])
            print(f"{name}: ran {len(r['noisy_runs']) + 1} times, other processes disturbed "
                  f"{len(r['noisy_runs'])} ({shares} of the CPU); the quietest run is shown")
    if busy:
        print("other processes (or kernel threads) used the CPU meanwhile, share of all "
              "cores; the figures are noisy: " + ", ".join(f"{n} {v:.0%}"
                                                           for n, v in busy.items()))

    def goal(label: str, ours: float | None, base: float | None, limit: float) -> None:
        if ours is None or base is None:
            print(f"goal {label} <= {limit:.2f}x: not measured")
            return
        ratio = ours / base
        print(f"goal {label} <= {limit:.2f}x: {'met' if ratio <= limit else 'NOT met'} "
              f"({ours:,.0f} ms / {base:,.0f} ms = {ratio:.2f}x)")

    get = lambda n, k: rows[n][k] if n in rows else None
    goal("kvstrata-g2 returning TTFT / floor", get("kvstrata-g2", "return_ms"), floor, GOAL_G2)
    goal("kvstrata-g3 returning TTFT / floor", get("kvstrata-g3", "return_ms"), floor, GOAL_G3)
    for name in ("kvstrata-g2", "kvstrata-g3"):
        goal(f"{name} cold TTFT / null cold", get(name, "cold_ms"), get("null", "cold_ms"),
             GOAL_COLD)
    for name, limit in (("kvstrata-g2", GOAL_G2), ("kvstrata-g3", GOAL_G3)):
        if name in rows and floor:
            print(result_line(f"vllm_return_ttft_{name[9:]}", rows[name]["return_ms"], floor,
                              "ms", goal=f"<={limit}x"))
    if "example" in rows and floor:
        print(result_line("vllm_return_ttft_example", rows["example"]["return_ms"], floor, "ms"))
    print(f"total run time {wall_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smaller run: 3 conversations x 2 turns")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from {','.join(CONFIGS + EXTRA_CONFIGS)} "
                             f"(default: all but {','.join(EXTRA_CONFIGS)})")
    parser.add_argument("--json", default=None, help="write the raw numbers to this file")
    parser.add_argument("--arch", default="llama",
                        choices=("llama", "gemma3", "deepseek_v2", "qwen3_next"),
                        help="the random model's architecture (see the module docstring)")
    parser.add_argument("--window", type=int, default=512,
                        help="tokens of gemma3's sliding window")
    parser.add_argument("--model-dir", default=None,
                        help="where the random BENCH-shaped model is (made if missing; "
                             "default ~/.cache/kvstrata/models/bench[-ARCH])")
    parser.add_argument("--work-dir", default=None,
                        help="logs, G3 slab, ExampleConnector files (default: a temp dir, "
                             "removed after a clean run)")
    parser.add_argument("--conversations", type=int, default=None,
                        help="conversations played interleaved (default 3)")
    parser.add_argument("--turns", type=int, default=None,
                        help="turns per conversation (default 5, --quick 2)")
    parser.add_argument("--first", type=int, default=1500, help="tokens of a first turn")
    parser.add_argument("--answer", type=int, default=32, help="tokens of each answer")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token ids")
    parser.add_argument("--g2", default="2GiB", help="G2 size of kvstrata-g2")
    parser.add_argument("--g2-small", default="auto",
                        help="G2 size of kvstrata-g3 (auto: the longest conversation's blocks "
                             "+ 4; smaller than the conversations played between two turns)")
    parser.add_argument("--g2-tiny", default="4MiB",
                        help="G2 size of kvstrata-g3-tiny (fewer blocks than one turn: "
                             "kvstrata skips the blocks it cannot place, G3 gets a few)")
    parser.add_argument("--g3", default="4GiB", help="G3 size of kvstrata-g3")
    parser.add_argument("--kv-cache-gib", type=int, default=2,
                        help="VLLM_CPU_KVCACHE_SPACE (vLLM's own KV cache, GiB)")
    parser.add_argument("--noise-retries", type=int, default=1,
                        help="run a configuration again (keeping the quieter run) when other "
                             f"processes used more than {NOISY * 100:.0f}%% of the CPU meanwhile")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        run_child(args._child, args._spec, args._out)
        return

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = set(names) - set(CONFIGS + EXTRA_CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; "
                     f"known: {', '.join(CONFIGS + EXTRA_CONFIGS)}")
    conversations = args.conversations or 3
    turns = args.turns or (2 if args.quick else 5)
    started = time.perf_counter()
    from dataclasses import replace

    from kvstrata.testing.random_model import BENCH, make_random_model

    global BLOCK_SIZE
    BLOCK_SIZE = BLOCK_SIZES[args.arch]
    model_dir = args.model_dir or os.path.expanduser(
        "~/.cache/kvstrata/models/bench" + ("" if args.arch == "llama" else f"-{args.arch}"))
    shape = replace(BENCH, sliding_window=args.window) if args.arch == "gemma3" else BENCH
    model = make_random_model(model_dir, shape, args.arch)
    temp = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="kvstrata-bench-vllm-") if temp else args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    workload = make_workload(args.seed, conversations, turns, args.first)
    if args.g2_small == "auto":
        args.g2_small = auto_g2_small(workload, args.answer)
    say(f"{conversations} conversations x {turns} turns, first turn {args.first} tokens, "
        f"answers {args.answer} tokens; configurations {', '.join(names)}; G2 of "
        f"kvstrata-g3 {args.g2_small}; work dir {work}")
    results: dict[str, dict] = {}
    for name in names:
        spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
        out_path.unlink(missing_ok=True)
        spec_path.write_text(json.dumps({
            "model": str(model), "answer": args.answer, "kv_cache_gib": args.kv_cache_gib,
            "block_size": BLOCK_SIZE,
            "kv_transfer_config": kv_transfer_config(name, work, args),
            "workload": workload}))
        result = run_configuration(name, spec_path, out_path, work, args.noise_retries,
                                   cleanup=lambda: [shutil.rmtree(work / sub, ignore_errors=True)
                                                    for sub in ("g3", "example")])
        results[name] = result
    wall = time.perf_counter() - started
    report(results, wall)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "summary": summarize(results), "results": results, "wall_s": wall}, indent=1))
    tidy_work_dir(work, temp, results)


if __name__ == "__main__":
    main()
