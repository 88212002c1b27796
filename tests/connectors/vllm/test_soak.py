"""Soak (issue 24): a long run keeps no :class:`TransferResult` alive.

The transfer engine used to put every result both on its plan's future and on a
``completions`` queue that the vLLM worker never drained, so a server kept every result for
its whole life. Futures are now the only result channel. These tests run thousands of
transfers and count the live ``TransferResult`` objects (``gc.get_objects()`` after
``gc.collect()``) after a warm-up and again later: the count must stay within a small constant
of the warm-up's, far below the number of transfers (the old queue kept one result per
transfer: thousands here). They also check the work happened, so they cannot pass vacuously.

* the connector's two halves around the simulated vLLM (sim.py), two tensor-parallel ranks:
  requests sharing a few prompt prefixes, stored G1 -> G2 -> G3 and loaded back from G2 and
  G3;
* a :class:`TransferEngine` driven by an :class:`EngineExecutor` directly, 2,000 plans on
  G1->G2, G2->G3, G3->G1 and G2->G1 (the size of the original report).

Checked against the old behaviour (the engine's ``_execute`` patched, for one run, to also
queue each result as the ``completions`` queue did): the counts grew to [564, 2566, 4602,
6712] and [192, 1024, 1984] and both tests failed; now they stay at 0.
"""

from __future__ import annotations

import gc
import queue
import random

import pytest
import torch

from kvstrata.physical import (DeviceStorage, DiskStorage, HostStorage, LayoutConfig,
                               TransferEngine, TransferPlan)
from kvstrata.placement import EngineExecutor
from kvstrata.protocol.results import TransferResult

SLACK = 16
"""Results allowed alive beyond the warm-up's count: a few in flight or in a local of a
transfer thread; it must not grow with the number of transfers."""


def live_results() -> int:
    """``TransferResult`` objects alive now (after a full collection)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is TransferResult)


def assert_bounded(counts: list[int], transfers: int) -> None:
    """``counts[0]`` was taken after the warm-up, the others later (the last at the end):
    none may exceed it by more than :data:`SLACK`, and the bound must be far below the number
    of ``transfers`` run after the warm-up (a kept result per transfer would exceed it)."""
    bound = counts[0] + SLACK
    print(f"live TransferResults {counts} over {transfers} transfers after the warm-up")
    assert max(counts[1:]) <= bound, \
        f"live TransferResults grew: {counts} (bound {bound}) over {transfers} transfers"
    assert transfers >= 50 * bound, (transfers, bound)       # the check can tell


# -- the connector halves ------------------------------------------------------------------
BS = 4
RANKS = 2
DOCS = 24                 # shared prefixes: four blocks each, more than G2 and G3 hold
WARMUP_ROUNDS = 25        # four requests per round
ROUNDS = 300
CHECKS = 3                # counts after the warm-up (the last at the end)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 3 for i in range(n)]


@pytest.fixture
def make(tmp_path):
    pytest.importorskip("vllm")
    from .sim import SimEngine, sim_factory

    yield from sim_factory(SimEngine, tmp_path, BS)


def test_the_connector_halves_keep_no_result_over_thousands_of_transfers(make):
    from .sim import assert_idle

    sim = make(g1_blocks=256, g2_blocks=16, g3_blocks=64, ranks=RANKS)
    rng = random.Random(24)
    stats = sim.scheduler.planner.stats

    def play(first: int, last: int) -> None:
        """Rounds of four requests: a shared four-block prefix (one of DOCS, loaded back
        when G2 or G3 still holds it) and a request's own tail of 1..7 tokens."""
        for round_ in range(first, last):
            for i in range(4):
                k = round_ * 4 + i
                sim.add(f"r{k}", prompt(rng.randrange(DOCS), 4 * BS)
                        + prompt(10_000 + k, rng.randrange(1, 2 * BS)), max_new=2)
            sim.run()
            sim.finished.clear()            # the harness's own record of finished requests
            sim.scheduler.take_events()     # vLLM takes the connector's events every step

    def plans() -> int:
        return sum(s.plans for s in stats.paths.values())

    play(0, WARMUP_ROUNDS)
    counts = [live_results()]
    plans_at_warmup = plans()
    step = (ROUNDS - WARMUP_ROUNDS) // CHECKS
    for check in range(CHECKS):
        last = ROUNDS if check == CHECKS - 1 else WARMUP_ROUNDS + (check + 1) * step
        play(WARMUP_ROUNDS + check * step, last)
        counts.append(live_results())

    # the work happened: stores down both tiers, loads back from both, nothing failed
    paths = {p: (s.plans, s.blocks, s.failed_blocks) for p, s in stats.paths.items()}
    assert {"G1->G2", "G2->G3", "G2->G1", "G3->G1"} <= set(paths), paths
    assert paths["G1->G2"][1] >= 2_000 and paths["G2->G3"][1] >= 2_000, paths
    assert paths["G2->G1"][0] >= 100 and paths["G3->G1"][0] >= 200, paths
    assert all(failed == 0 for _, _, failed in paths.values()), paths
    counters = sim.scheduler.counters
    assert counters.blocks_loaded.get("G2", 0) >= 300, counters.as_dict()
    assert counters.blocks_loaded.get("G3", 0) >= 800, counters.as_dict()
    assert counters.blocks_load_failed == 0 and not sim.invalid_seen
    plans_run = plans() - plans_at_warmup
    assert plans_run >= 2_000, paths
    transfers = plans_run * RANKS                 # every plan runs on every rank's engine
    assert_bounded(counts, transfers)
    assert_idle(sim)


# -- TransferEngine + EngineExecutor -------------------------------------------------------
PLANS = 2_000
WAVE = 16                 # blocks per stage of a wave; a wave is 4 * WAVE plans
WARMUP_WAVES = 3


def test_engine_and_executor_keep_no_result_over_2000_plans(tmp_path):
    config = LayoutConfig(num_blocks=WAVE, num_layers=2, outer_dim=2, page_size=4,
                          inner_dim=8, dtype="bfloat16")
    g1 = DeviceStorage.allocate(config.with_blocks(2 * WAVE), device="cpu")
    g2 = HostStorage(config.with_blocks(WAVE).with_alignment(512))
    g3 = DiskStorage(config.with_blocks(WAVE), tmp_path, o_direct=False)
    gen = torch.Generator().manual_seed(24)
    for region in g1.memory.regions:                   # bytes worth copying
        raw = region.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    engine = TransferEngine({"G1": g1, "G2": g2, "G3": g3}, queue_depth=4)
    results: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
    executor = EngineExecutor(engine, results.put)
    seen: set[int] = set()
    moved = {"G1->G2": 0, "G2->G3": 0, "G3->G1": 0, "G2->G1": 0}
    job = 0
    backlogged = 0

    def stage(path: str, src: list[int], dst: list[int], hashes: list[int]) -> None:
        """One single-block plan per block, all submitted at once (the executor backlogs
        what the path's queue cannot take), then every result taken and dropped."""
        nonlocal job, backlogged
        plans = []
        for s, d, h in zip(src, dst, hashes):
            plans.append(TransferPlan.for_path(path, [s], [d], [h], job_id=job))
            job += 1
        executor.submit(plans)
        backlogged = max(backlogged, executor.backlogged)
        del plans
        for _ in src:
            result = results.get(timeout=60)
            executor.settled(result)
            assert result.all_ok, result.failures
            assert result.job_id not in seen
            seen.add(result.job_id)
            moved[path] += 1
            del result

    def wave(n: int) -> None:
        """G1 -> G2 -> G3 -> G1 (the other half of G1), and G2 -> G1."""
        ids = list(range(WAVE))
        hashes = [(n << 20) + 100 + i for i in ids]
        stage("G1->G2", ids, ids, hashes)
        stage("G2->G3", ids, ids, hashes)
        stage("G3->G1", ids, [WAVE + i for i in ids], hashes)
        stage("G2->G1", ids, [WAVE + i for i in reversed(ids)], hashes)

    waves = -(-PLANS // (4 * WAVE))
    try:
        for n in range(WARMUP_WAVES):
            wave(n)
        counts = [live_results()]
        for n in range(WARMUP_WAVES, waves):
            wave(n)
            if n == waves // 2:
                counts.append(live_results())
        counts.append(live_results())
    finally:
        engine.close()
        for storage in (g1, g2, g3):
            storage.close()
    assert len(seen) == job == waves * 4 * WAVE >= PLANS
    assert set(moved.values()) == {waves * WAVE}
    assert backlogged > 0 and executor.backlogged == 0      # the backlog was used, and emptied
    assert_bounded(counts, (waves - WARMUP_WAVES) * 4 * WAVE)

