"""Per-step overhead of the vLLM connector's scheduler half (no engine, no bytes).

vLLM calls the scheduler half on its own thread every engine step, so its cost adds to every
step's latency. This bench drives :class:`~kvstrata.connectors.vllm.scheduler.SchedulerHalf`
the way vLLM's scheduler does for a batch of ``--requests`` running requests: each step every
request decodes one token (a block fills every ``block_size`` steps and is offered to G2),
finished requests are replaced by new ones whose prompts share a system prompt (a lookup, an
onboard of the shared part, stores of the rest), and the workers' results come back at once.
It prints the mean and 99th percentile time per step spent inside the connector's calls
(the harness's own work is not counted), beside the
same-run time of vLLM's own per-step request hashing for the same tokens (``sha256`` block
hashes, vLLM's default prefix-caching hash), the cost vLLM itself already pays per step.

Goal: under 1 ms per step with 64 requests.

    python bench/bench_connector_step.py [--requests 64] [--steps 2000] [--block-size 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvstrata.connectors.vllm.metadata import WorkerReport
from kvstrata.connectors.vllm.scheduler import SchedulerHalf
from kvstrata.connectors.vllm.settings import KvGeometry, settings_from
from kvstrata.protocol.results import TransferResult


class _Request:
    def __init__(self, req_id: str, prompt: list[int], output_len: int) -> None:
        self.request_id = req_id
        self.prompt_token_ids = prompt
        self.all_token_ids = list(prompt)
        self.num_computed_tokens = 0
        self.output_len = output_len
        self.lora_request = None
        self.cache_salt = None
        self.mm_features = []
        self.block_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class _State:
    def __init__(self, table):
        self.table = table

    def get_block_ids(self, req_id):
        return (self.table[req_id],)


class _Out:
    def __init__(self, num_scheduled, table):
        self.num_scheduled_tokens = num_scheduled
        self.preempted_req_ids = set()
        self.kv_connector_block_state = _State(table)


class _ConnOut:
    def __init__(self, report, recving):
        self.kv_connector_worker_meta = report
        self.finished_recving = recving
        self.finished_sending = None


def run(requests: int, steps: int, block_size: int, prompt_len: int) -> dict:
    rng = random.Random(0)
    geometry = KvGeometry(block_size, 8, 4, 128, "bfloat16", 100_000)
    settings = settings_from({"tiers": {"G2": {"blocks": 20_000}}}, geometry, env={})
    half = SchedulerHalf(settings)
    system = [rng.randrange(3, 30000) for _ in range(prompt_len // 2)]
    free = list(range(100_000))
    live: dict[str, _Request] = {}
    counter = 0
    step_times: list[float] = []
    hash_times: list[float] = []
    try:
        from vllm.utils.hashing import sha256 as vllm_sha256
    except Exception:                                   # vLLM absent: a plain sha256 of pickle
        import hashlib
        import pickle

        def vllm_sha256(obj):
            return hashlib.sha256(pickle.dumps(obj)).digest()
    pending_results: list[TransferResult] = []
    loading: set[str] = set()
    clock = time.perf_counter
    for step in range(steps):
        spent = 0.0            # time inside the connector's calls only, not the harness's
        # results of the previous step's plans (all succeeded at once)
        report = WorkerReport([(0, r) for r in pending_results]) if pending_results else None
        recving = set(loading)
        loading.clear()
        output = _ConnOut(report, recving)
        t0 = clock()
        half.update_connector_output(output)
        spent += clock() - t0
        pending_results = []
        for req_id in [r for r, q in live.items() if q.num_tokens - len(q.prompt_token_ids)
                       >= q.output_len]:
            request = live.pop(req_id)
            t0 = clock()
            half.request_finished(request, request.block_ids)
            spent += clock() - t0
            free.extend(request.block_ids)
        while len(live) < requests:
            counter += 1
            prompt = system + [rng.randrange(3, 30000) for _ in range(prompt_len // 2)]
            request = _Request(f"r{counter}", prompt, rng.randrange(16, 256))
            need = -(-request.num_tokens // block_size) + 1
            ids, free = free[:need], free[need:]
            t0 = clock()
            n, is_async = half.get_num_new_matched_tokens(request, 0)
            request.block_ids = ids
            half.update_state_after_alloc(request, (request.block_ids,), n)
            spent += clock() - t0
            request.num_computed_tokens = n
            if is_async:
                loading.add(request.request_id)
            live[request.request_id] = request
        scheduled = {}
        for request in live.values():
            scheduled[request.request_id] = max(1, request.num_tokens
                                                - request.num_computed_tokens)
        out = _Out(scheduled, {r: q.block_ids for r, q in live.items()})
        t0 = clock()
        orders = half.build_connector_meta(out)
        spent += clock() - t0
        pending_results = [TransferResult.success(p) for p in orders.plans]
        step_times.append(spent)
        # vLLM's own per-step hashing of the blocks this step fills, for scale
        t2 = time.perf_counter()
        parent = b"\0" * 32
        for req_id, n in scheduled.items():
            request = live[req_id]
            done = request.num_computed_tokens + n
            first = request.num_computed_tokens // block_size
            for b in range(first, done // block_size):
                parent = vllm_sha256((parent, tuple(request.all_token_ids[
                    b * block_size:(b + 1) * block_size]), None))
        hash_times.append(time.perf_counter() - t2)
        for req_id, n in scheduled.items():             # the forward, then sampling
            request = live[req_id]
            request.num_computed_tokens += n
            request.all_token_ids.append(rng.randrange(3, 30000))
            if -(-request.num_tokens // block_size) > len(request.block_ids):
                request.block_ids.append(free.pop())
    warm = step_times[steps // 10:]
    return {"requests": requests, "steps": steps, "block_size": block_size,
            "mean_ms": statistics.fmean(warm) * 1e3,
            "p99_ms": sorted(warm)[int(len(warm) * 0.99)] * 1e3,
            "vllm_hash_mean_ms": statistics.fmean(hash_times[steps // 10:]) * 1e3,
            "blocks_offered": half.counters.blocks_offered,
            "blocks_loaded": dict(half.counters.blocks_loaded)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=1024)
    args = parser.parse_args()
    r = run(args.requests, args.steps, args.block_size, args.prompt_len)
    print(f"scheduler half, {r['requests']} requests, block {r['block_size']}: "
          f"{r['mean_ms']:.3f} ms/step mean, {r['p99_ms']:.3f} ms p99 "
          f"(goal < 1 ms: {'met' if r['mean_ms'] < 1 else 'NOT met'})")
    print(f"  vLLM's own sha256 block hashing of the same steps: {r['vllm_hash_mean_ms']:.3f} "
          f"ms/step -> connector / vLLM hashing = {r['mean_ms'] / max(r['vllm_hash_mean_ms'], 1e-9):.2f}")
    print(f"  blocks offered {r['blocks_offered']}, loaded {r['blocks_loaded']}")


if __name__ == "__main__":
    main()
