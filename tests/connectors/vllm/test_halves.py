"""The connector's two halves around a simulated vLLM (tests/connectors/vllm/sim.py), real
bytes: stores after the forward, loads byte-exact from G2 and G3, failed loads reported for
recompute, finished requests held while stores read their blocks, preemption flushes, several
tensor-parallel ranks, and every pool back to idle at the end."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

pytest.importorskip("vllm")

from kvstrata.tokens import hash_blocks  # noqa: E402

from .sim import (LAYERS, SimEngine, assert_idle, block_kv, sim_factory,  # noqa: E402
                  slow_path)

BS = 4


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 3 for i in range(n)]


@pytest.fixture
def make(tmp_path):
    yield from sim_factory(SimEngine, tmp_path, BS)


def store_then_push_out_of_g2(sim: SimEngine, tokens: list[int], others: int,
                              seed: int) -> None:
    """Run a request, then ``others`` of the same size so its blocks leave G2 (kept in G3)."""
    sim.add("a", tokens)
    sim.run()
    for i in range(others):
        sim.add(f"x{i}", prompt(seed + i, len(tokens)))
        sim.run()


def flip_bytes(path, step: int, mask: int) -> None:
    with open(path, "r+b") as fh:
        data = bytearray(fh.read())
        for i in range(0, len(data), step):
            data[i] ^= mask
        fh.seek(0)
        fh.write(data)


def run_and_check_load(sim: SimEngine, req_id: str, tokens: list[int], expect_blocks: int,
                       max_new: int = 2) -> None:
    """Add a request, step until its load finished, check the loaded bytes, run to idle."""
    request = sim.add(req_id, tokens, max_new=max_new)
    deadline = time.monotonic() + 30
    while request.state != "running" and time.monotonic() < deadline:
        sim.step()
        time.sleep(0.001)                  # the copies run on the transfer threads
    assert request.state == "running", "the load never finished"
    assert request.loaded == expect_blocks
    hashes = sim.scheduler._requests[req_id].seq
    for rank, layers in enumerate(sim.kv):
        for b in range(expect_blocks):
            if request.block_ids[b] in sim.invalid_seen:
                continue
            for layer in range(LAYERS):
                assert torch.equal(layers[layer][request.block_ids[b]],
                                   block_kv(hashes[b], layer, rank, BS)), (rank, b, layer)
    sim.run()


def test_a_returning_prefix_is_loaded_from_g2_byte_exact(make):
    sim = make()
    tokens = prompt(1, 10 * BS + 2)
    sim.add("a", tokens)
    sim.run()
    counters = sim.scheduler.counters
    assert counters.blocks_offered >= 10
    assert sim.scheduler.planner.pools["G2"].status().inactive >= 10
    # vLLM's own cache is gone (the simulator keeps none): the prefix comes back from G2,
    # all but the block holding the last prompt token
    run_and_check_load(sim, "b", tokens + [7, 8, 9], expect_blocks=10)
    assert counters.blocks_loaded == {"G2": 10}
    assert_idle(sim)


def test_never_the_whole_prompt(make):
    sim = make()
    tokens = prompt(2, 6 * BS)            # exactly six blocks
    sim.add("a", tokens)
    sim.run()
    request = sim.add("b", tokens)
    n, is_async = sim.scheduler.get_num_new_matched_tokens(request, 0)
    assert (n, is_async) == (5 * BS, True)         # the last token is computed
    n, is_async = sim.scheduler.get_num_new_matched_tokens(request, 5 * BS)
    assert (n, is_async) == (0, False)            # vLLM had it all already
    sim.requests.pop("b")
    sim.scheduler.request_finished(request, [])
    assert_idle(sim)


def test_loads_from_g3_when_g2_evicted_them(make):
    sim = make(g2_blocks=10, g3_blocks=64)          # G2 holds one request's blocks
    first = prompt(3, 8 * BS + 1)
    store_then_push_out_of_g2(sim, first, 3, seed=10)
    run_and_check_load(sim, "b", first + [5], expect_blocks=8)
    assert sim.scheduler.counters.blocks_loaded.get("G3", 0) >= 4
    assert_idle(sim)


def test_corrupt_g3_block_is_a_load_error_and_the_rest_recomputed(make):
    sim = make(g2_blocks=8, g3_blocks=64, extra={"verify_host_reads": True})
    first = prompt(4, 6 * BS + 1)
    store_then_push_out_of_g2(sim, first, 2, seed=20)
    flip_bytes(sim.workers[0].storages.by_tier["G3"].path, 4096, 0xFF)   # the whole slab
    request = sim.add("b", first + [5])
    sim.run()
    assert request.loaded > 0
    assert sim.invalid_seen, "corrupt blocks must be reported to vLLM"
    assert sim.scheduler.counters.blocks_load_failed > 0
    assert_idle(sim)


def test_finished_request_is_held_while_its_stores_run(make, monkeypatch):
    sim = make()
    worker = sim.workers[0]
    saves = []
    real_save = worker.save
    monkeypatch.setattr(worker, "save", lambda: saves.append(1))   # stores never start
    tokens = prompt(5, 4 * BS + 1)
    sim.add("a", tokens, max_new=1)
    for _ in range(3):
        sim.step()
    assert "a" in sim.held and saves, "the finished request must wait for its stores"
    blocks = set(sim.held["a"].block_ids)
    assert blocks.isdisjoint(sim.free)
    monkeypatch.setattr(worker, "save", real_save)
    sim.run()
    assert "a" in sim.finished and blocks <= set(sim.free)
    assert_idle(sim)


def test_preemption_flushes_stores_before_blocks_are_overwritten(make):
    sim = make()
    restore = slow_path(sim.workers[0], "G1->G2", 0.3)   # a store still reading at preemption
    tokens = prompt(6, 5 * BS + 1)
    request = sim.add("a", tokens, max_new=6)
    sim.step()                                  # prefill; its stores start after the forward
    sim.preempt("a")                            # freed; the next forward scribbles over them
    sim.step()                                  # handle_preemptions waits for the stores first
    restore()
    sim.run()
    run_and_check_load(sim, "b", tokens + [1, 2], expect_blocks=5)   # G2 holds the real KV
    assert request.request_id in sim.finished
    assert_idle(sim)


def test_without_the_flush_the_scribble_would_be_stored(make, monkeypatch):
    """The test above can fail: with handle_preemptions doing nothing, G2 gets the scribble
    and the load hands back -7s (caught here by comparing bytes)."""
    sim = make(extra={"verify_host_reads": False})
    worker = sim.workers[0]
    monkeypatch.setattr(worker, "flush_g1_readers", lambda: None)
    restore = slow_path(worker, "G1->G2", 0.3)
    tokens = prompt(6, 5 * BS + 1)
    sim.add("a", tokens, max_new=6)
    sim.step()
    sim.preempt("a")
    sim.step()
    restore()
    sim.run()
    with pytest.raises(AssertionError):
        run_and_check_load(sim, "b", tokens + [1, 2], expect_blocks=5)


def test_two_tensor_parallel_ranks_combine_results(make):
    sim = make(ranks=2)
    tokens = prompt(7, 7 * BS + 3)
    sim.add("a", tokens)
    sim.run()
    run_and_check_load(sim, "b", tokens, expect_blocks=7)      # both ranks' shards
    assert sim.scheduler.counters.blocks_loaded == {"G2": 7}
    assert_idle(sim)


def test_a_failure_on_one_rank_fails_the_block(make):
    sim = make(ranks=2, g2_blocks=7, g3_blocks=32)
    tokens = prompt(8, 5 * BS + 1)
    store_then_push_out_of_g2(sim, tokens, 1, seed=30)
    flip_bytes(sim.workers[1].storages.by_tier["G3"].path, 4096, 0x55)   # rank 1's copy only
    request = sim.add("b", tokens)
    sim.run()
    assert request.loaded > 0 and sim.invalid_seen
    assert sim.scheduler.counters.blocks_load_failed > 0
    assert_idle(sim)


def test_many_requests_small_g2_nothing_leaks(make):
    sim = make(g1_blocks=256, g2_blocks=16, g3_blocks=48)
    shared = prompt(9, 3 * BS)                       # a shared system prompt
    for round_ in range(3):
        for i in range(6):
            sim.add(f"r{round_}.{i}", shared + prompt(100 + i, 2 * BS + i), max_new=3)
        sim.run()
    assert sim.scheduler.counters.blocks_loaded, "later rounds must load the shared prefix"
    assert_idle(sim)


def test_aborted_while_loading_is_not_held_twice(make):
    sim = make()
    tokens = prompt(11, 6 * BS + 1)
    sim.add("a", tokens)
    sim.run()
    request = sim.add("b", tokens)
    sim.step()                                     # load planned and shipped
    assert request.state == "loading" or "b" not in sim.requests
    # vLLM aborts it: request_finished says False (vLLM already waits for the load)
    assert sim.scheduler.request_finished(request, list(request.block_ids)) is False
    del sim.requests["b"]
    deadline = time.monotonic() + 30
    while not sim.scheduler.idle and time.monotonic() < deadline:   # the load still completes
        sim.step()
        time.sleep(0.001)
    assert sim.scheduler.idle
    assert_idle(sim)


def test_a_lora_name_pointed_at_another_adapter_shares_nothing(make):
    """vLLM keys its own prefix cache by an adapter's name and path: a name re-pointed at
    another adapter loaded the first adapter's KV from G2."""
    from types import SimpleNamespace

    sim = make()
    tokens = prompt(13, 4 * BS + 1)
    request = sim.add("a", tokens)
    request.lora_request = SimpleNamespace(lora_name="ad", lora_path="/adapters/a")
    sim.run()

    def matched(req_id: str, path: str) -> int:
        asking = sim.add(req_id, tokens)
        asking.lora_request = SimpleNamespace(lora_name="ad", lora_path=path)
        count = sim.scheduler.get_num_new_matched_tokens(asking, 0)[0]
        sim.scheduler.request_finished(sim.requests.pop(req_id), [])
        return count

    assert matched("b", "/adapters/b") == 0
    assert matched("c", "/adapters/a") == 4 * BS
    assert_idle(sim)


def test_requests_with_other_salts_never_share(make):
    """Neither in G2 nor, once pushed out of G2, in G3: a prompt stored for one salt is no hit
    for another (nor for no salt), and is one for its own."""
    sim = make()
    tokens = prompt(12, 5 * BS + 1)
    request = sim.add("a", tokens)
    request.cache_salt = "tenant-1"
    sim.run()

    def matched(req_id: str, salt: str | None) -> tuple[int, str | None]:
        asking = sim.add(req_id, tokens)
        asking.cache_salt = salt
        count = sim.scheduler.get_num_new_matched_tokens(asking, 0)[0]
        load = sim.scheduler._requests[req_id].load
        sim.scheduler.request_finished(sim.requests.pop(req_id), [])
        return count, load[1][0] if load else None

    assert matched("b", "tenant-2") == (0, None)
    assert matched("n", None) == (0, None)
    assert matched("c", "tenant-1") == (5 * BS, "G2")
    for i in range(6):                        # push it out of G2 (kept in G3)
        sim.add(f"x{i}", prompt(100 + i, 5 * BS + 1))
        sim.run()
    assert matched("d", "tenant-2") == (0, None)
    assert matched("e", "tenant-1") == (5 * BS, "G3")
    assert_idle(sim)


def test_stores_off_and_loads_off(make):
    sim = make(extra={"store": False})
    sim.add("a", prompt(13, 4 * BS + 1))
    sim.run()
    assert sim.scheduler.planner.pools["G2"].status().inactive == 0
    sim2 = make(extra={"load": False})
    tokens = prompt(14, 4 * BS + 1)
    sim2.add("a", tokens)
    sim2.run()
    request = sim2.add("b", tokens)
    assert sim2.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    sim2.scheduler.request_finished(sim2.requests.pop("b"), [])


def test_vllm_events_name_the_tier(make):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    sim = make(g2_blocks=6, g3_blocks=16)
    sim.add("a", prompt(15, 5 * BS + 1))
    sim.run()
    sim.add("x", prompt(25, 5 * BS + 1))
    sim.run()
    events = sim.scheduler.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert {e.medium for e in stored} == {"CPU", "STORAGE"}
    assert {e.medium for e in removed} == {"CPU"}            # G2 of 6 blocks evicted
    g3 = [h for e in stored if e.medium == "STORAGE" for h in e.block_hashes]
    assert len(g3) == len(set(g3)) == 10
    assert sim.scheduler.take_events() == []


def test_reset_cache_drops_every_block_and_says_so(make):
    from vllm.distributed.kv_events import BlockRemoved

    sim = make()
    sim.add("a", prompt(16, 4 * BS + 1))
    sim.run()
    sim.scheduler.take_events()
    assert sim.scheduler.reset_cache() is True
    assert all(p.status().inactive == 0 for p in sim.scheduler.planner.pools.values())
    removed = [e for e in sim.scheduler.take_events() if isinstance(e, BlockRemoved)]
    assert {e.medium for e in removed} == {"CPU", "STORAGE"}


def test_worker_shutdown_keeps_the_durable_slab_and_frees_its_directory(make, tmp_path):
    from kvstrata.physical.storage.disk_home import DiskTierHome

    sim = make()
    sim.add("a", prompt(17, 4 * BS + 1))
    sim.run()
    slab = sim.workers[0].storages.by_tier["G3"].path
    assert os.path.exists(slab)
    sim.workers[0].shutdown()
    assert os.path.exists(slab)                  # for the next start (tests/.../test_restart)
    home = slab.parent
    DiskTierHome.claim(home.parent, tier="g3", rank=0,
                       fingerprint=home.name.rsplit("-", 1)[1]).release()   # lock released


def test_a_truncated_slab_is_a_load_error_not_a_crash(make):
    sim = make(g2_blocks=8, g3_blocks=64)
    first = prompt(18, 6 * BS + 1)
    store_then_push_out_of_g2(sim, first, 2, seed=40)
    os.truncate(sim.workers[0].storages.by_tier["G3"].path, 0)     # the blocks are gone
    request = sim.add("b", first + [5])
    sim.run()
    assert request.loaded > 0 and sim.invalid_seen
    assert sim.scheduler.counters.blocks_load_failed > 0
    assert_idle(sim)


def test_the_gpu_builds_staged_copy_path_on_cpu(make):
    """With CUDA the worker copies through a staging buffer (StagedCopyEngine); its logic
    runs here on CPU tensors (stage_all), byte-exact both ways."""
    from kvstrata.physical.copy import StagedCopyEngine

    sim = make(copy_engine=StagedCopyEngine(stage_all=True))
    tokens = prompt(19, 6 * BS + 2)
    sim.add("a", tokens)
    sim.run()
    run_and_check_load(sim, "b", tokens, expect_blocks=6)
    assert_idle(sim)


def test_a_g2_smaller_than_a_step_says_what_it_did_not_store(make, caplog):
    sim = make(g2_blocks=3, g3_blocks=32)
    with caplog.at_level("WARNING", logger="kvstrata.connectors.vllm.scheduler"):
        sim.add("a", prompt(50, 8 * BS + 1))
        sim.run()
    assert sim.scheduler.counters.blocks_not_stored.get("G2:no_slot", 0) == 5
    assert any("not stored in G2" in r.getMessage() for r in caplog.records)
    assert_idle(sim)


def test_status_shows_learned_costs_and_the_prefill_rate(make):
    sim = make(g2_blocks=16, g3_blocks=64)
    for i in range(3):
        sim.add(f"r{i}", prompt(80 + i, 6 * BS + 1))
        sim.run()
    costs = sim.scheduler.status()["costs"]
    assert costs["prefill_samples"] >= 1 and costs["prefill_tokens_per_s"] > 0
    assert costs["paths"]["G1->G2"]["samples"] >= 1
    assert_idle(sim)


def _teach(costs, path: str, gbps: float, overhead: float, prefill: float) -> None:
    for _ in range(10):
        costs.transfer_done(path, 8, 1 << 20, (1 << 20) / (gbps * 1e9),
                            (1 << 20) / (gbps * 1e9) + overhead, ())
        costs.observe_prefill(4096, 4096 / prefill)


@pytest.mark.parametrize("disk_gbps, disk_overhead", [(1e-6, 5.0), (10.0, 1e-5)],
                         ids=["slow-disk", "fast-disk"])
def test_cost_aware_recomputes_what_a_slow_tier_holds_and_loads_a_fast_one(make, disk_gbps,
                                                                          disk_overhead):
    sim = make(g2_blocks=6, g3_blocks=64, extra={"cost_aware": True})
    first = prompt(90, 8 * BS + 1)
    store_then_push_out_of_g2(sim, first, 1, seed=91)        # its prefix now starts in G3
    held = sim.scheduler.planner.lookup(hash_blocks(first, BS)[1][:8])
    assert held[0] == "G3"
    costs = sim.scheduler.planner.costs
    _teach(costs, "G2->G1", 10.0, 1e-5, prefill=1e6)
    _teach(costs, "G3->G1", disk_gbps, disk_overhead, prefill=1e6)
    slow = disk_gbps < 1
    if slow:
        request = sim.add("b", first + [5])
        sim.step()
        assert request.loaded == 0                            # recomputing is faster
        assert sim.scheduler.counters.tokens_not_loaded == {
            t: held.count(t) * BS for t in set(held)}
        sim.run()
    else:
        run_and_check_load(sim, "b", first + [5], expect_blocks=len(held))
        assert not sim.scheduler.counters.tokens_not_loaded
    assert_idle(sim)


def test_cost_aware_off_loads_everything_held(make):
    sim = make(g2_blocks=6, g3_blocks=64, extra={"cost_aware": False})
    first = prompt(92, 8 * BS + 1)
    store_then_push_out_of_g2(sim, first, 1, seed=93)
    held = sim.scheduler.planner.lookup(hash_blocks(first, BS)[1][:8])
    assert "G3" in held
    _teach(sim.scheduler.planner.costs, "G3->G1", 1e-6, 5.0, prefill=1e6)
    run_and_check_load(sim, "b", first + [5], expect_blocks=len(held))
    assert not sim.scheduler.counters.tokens_not_loaded


def test_prefill_rate_comes_from_the_workers_timed_forwards(make, monkeypatch):
    """Prefilling steps are numbered and timed by every worker from the metadata binding to
    wait_for_save; the first rank's report counts (tokens / seconds), decode steps are not
    timed, idle time between steps never counts, and reports that never come are bounded."""
    from kvstrata.connectors.vllm import scheduler as scheduler_module

    sim = make(g2_blocks=16, g3_blocks=0, ranks=2)
    forward_seconds = 0.05
    original = sim._forward

    def slow_forward(rank, scheduled):
        original(rank, scheduled)
        if any(n >= 2 * BS for n in scheduled.values()):
            time.sleep(forward_seconds)
    sim._forward = slow_forward
    costs = sim.scheduler.planner.costs
    sim.add("a", prompt(120, 12 * BS + 1), max_new=3)
    sim.step()                                         # the prefill: timed by both ranks
    assert costs.prefill.samples == 1                  # once, not once per rank
    time.sleep(0.3)                                    # the engine idles: not a slow prefill
    sim.run()                                          # decode steps: not timed
    assert costs.prefill.samples == 1
    rate = math.exp(costs.prefill.log_mean)            # the one sample (unblended)
    upper = (12 * BS + 1) / forward_seconds
    assert 0.2 * upper < rate <= upper * 1.01          # the forward's time, not the idle gap
    assert not sim.scheduler._timed_steps
    # a step whose reports never arrive is forgotten after a bounded number of steps
    monkeypatch.setattr(scheduler_module, "_TIMED_STEPS_KEPT", 4)
    for i in range(10):
        sim.scheduler._time_if_prefill(type("Out", (), {"num_scheduled_tokens": {"x": 4 * BS}}))
    assert len(sim.scheduler._timed_steps) <= 5
    assert_idle(sim)


def test_copies_that_finished_while_the_engine_did_not_step_teach_no_overhead(make):
    """An offline engine (``LLM.generate``) steps only while it has requests: the stores of a
    finished turn complete in the worker and wait there, unreported, until the next turn's
    first step. That wait is not the path's latency: counted, it taught the cost model
    seconds of overhead per copy (found by bench_vllm_connector.py --arch qwen3_next, where
    every load was then declined as slower than recompute)."""
    sim = make()
    for turn in range(10):
        request = sim.add(f"t{turn}", prompt(77 + turn, 6 * BS + 1), max_new=1)
        while request.request_id in sim.requests:
            sim.step()
        time.sleep(0.2)                        # nobody steps; the stores finish meanwhile
    sim.run()
    costs = sim.scheduler.planner.costs
    assert costs.overhead("G1->G2") < 0.01, costs.snapshot()


def test_the_wait_of_a_store_for_the_forward_is_not_its_paths_overhead(make):
    """A store is planned before the step's forward and copies after it (it reads what the
    forward writes): the forward's time is not the G1->G2 path's overhead (counted, a
    slow forward priced loads from G2, whose path borrows that estimate until measured, as
    slower than recompute)."""
    sim = make()
    forward = sim._forward

    def slow_forward(rank, scheduled):
        time.sleep(0.05)
        forward(rank, scheduled)

    sim._forward = slow_forward
    for turn in range(10):
        sim.add(f"t{turn}", prompt(99 + turn, 6 * BS + 1), max_new=1)
        sim.run()
    costs = sim.scheduler.planner.costs
    assert costs.overhead("G1->G2") < 0.01, costs.snapshot()


@pytest.mark.parametrize("load", [True, False])
def test_the_adaptive_duel_sees_every_request_from_its_first_block(make, load):
    """The duel learns from the requests: the scheduler shows it each one once, from its
    first block, whether it loads anything or not, loads on or off (it once saw only
    loads, and only the loaded part)."""
    sim = make(extra={"admission": "adaptive", "load": load})
    observers = sim.scheduler.planner._request_observers
    assert len(observers) == 1                # the bottom tier's duel
    seen: list[list[int]] = []
    serve = observers[0]
    observers[0] = lambda hashes: (seen.append(list(hashes)), serve(hashes))[1]
    first, second = prompt(60, 6 * BS + 1), prompt(60, 6 * BS) + prompt(61, 3 * BS + 1)
    sim.add("a", first)                       # a miss: loads nothing
    sim.run()
    sim.add("b", second)                      # loads its first 6 blocks from G2
    sim.run()
    assert bool(sim.scheduler.counters.blocks_loaded) is load
    assert seen == [hash_blocks(first, BS)[1], hash_blocks(second, BS)[1]]
