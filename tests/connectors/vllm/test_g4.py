"""The connector over a shared G4 in a real S3 server (SeaweedFS): a new engine -- new
scheduler, new workers, nothing in G1-G3 -- loads on its first request, byte-exact on every
rank, the prefix another engine stored; a block some rank's store lacks is a miss for all."""

from __future__ import annotations

import time
import uuid

import pytest

pytest.importorskip("vllm")

from kvstrata.physical.storage.s3client import S3Client  # noqa: E402
from kvstrata.tokens import hash_blocks  # noqa: E402

from .sim import SimEngine, assert_idle  # noqa: E402
from .test_halves import BS, prompt, run_and_check_load  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]




@pytest.fixture
def store(weed, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", weed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", weed.secret_key)
    return f"{weed.endpoint_url}/{weed.bucket}", f"t{uuid.uuid4().hex[:10]}"


def _engine(path, store, ranks, g3=False, engine_index=0):
    url, tenant = store
    tiers = {"G2": {"blocks": 16}, "G4": {"blocks": 512, "url": url}}
    if g3:
        tiers["G3"] = {"blocks": 32}
    return SimEngine(path, ranks=ranks, block_size=BS, engine_index=engine_index,
                     extra={"tiers": tiers, "list_interval": 3600, "tenant": tenant})


def _shutdown(sim):
    for worker in sim.workers:
        worker.shutdown()
    sim.scheduler.close()


@pytest.mark.parametrize("ranks,g3", [(1, False), (2, False), (1, True)])
def test_a_new_engine_loads_on_its_first_request_what_another_stored(tmp_path, store, ranks,
                                                                      g3):
    tokens = prompt(61, 8 * BS + 1)
    first = _engine(tmp_path / "a", store, ranks, g3)
    first.add("a", tokens)
    first.run()
    assert first.scheduler.planner.pools["G4"].status().inactive >= 8
    _shutdown(first)
    second = _engine(tmp_path / "b", store, ranks, g3)
    assert sorted(second.scheduler.planner.registry.hashes_in("G4")) == \
        sorted(hash_blocks(tokens, BS)[1])
    run_and_check_load(second, "b", tokens + [5], expect_blocks=8)
    assert second.scheduler.counters.blocks_loaded == {"G4": 8}
    assert_idle(second)
    _shutdown(second)


def test_data_parallel_engines_share_g4(tmp_path, store):
    """Engine 1 of two data-parallel engines loads, on its first request, what engine 0's
    workers stored: the same ranks in their engines store under the same fingerprint."""
    tokens = prompt(67, 6 * BS + 1)
    first = _engine(tmp_path, store, 2, g3=True, engine_index=0)
    first.add("a", tokens)
    first.run()
    _shutdown(first)
    second = _engine(tmp_path, store, 2, g3=True, engine_index=1)
    assert second.scheduler.planner.registry.hashes_in("G3") == set()   # its own G3
    run_and_check_load(second, "b", tokens + [5], expect_blocks=6)
    assert second.scheduler.counters.blocks_loaded == {"G4": 6}
    assert_idle(second)
    _shutdown(second)


def test_a_block_one_rank_lacks_is_a_miss_for_all(tmp_path, store, weed):
    tokens = prompt(62, 6 * BS + 1)
    first = _engine(tmp_path / "a", store, 2)
    first.add("a", tokens)
    first.run()
    rank1 = first.workers[1].storages.by_tier["G4"]
    third = [k for k in rank1.list_keys()
             if k.startswith(f"{hash_blocks(tokens, BS)[1][2]:016x}.")]
    assert len(third) == 1
    S3Client(weed.s3_config()).delete(rank1.namespace + third[0])
    _shutdown(first)
    second = _engine(tmp_path / "b", store, 2)
    assert len(second.scheduler.planner.registry.hashes_in("G4")) == 5
    run_and_check_load(second, "b", tokens + [5], expect_blocks=2)
    assert_idle(second)
    _shutdown(second)


def test_blocks_deleted_after_the_listing_are_load_errors_recomputed_and_stored_again(tmp_path, store,
                                                                         weed):
    tokens = prompt(63, 5 * BS + 1)
    first = _engine(tmp_path / "a", store, 1)
    first.add("a", tokens)
    first.run()
    _shutdown(first)
    second = _engine(tmp_path / "b", store, 1)           # learned all five
    storage = second.workers[0].storages.by_tier["G4"]
    client = S3Client(weed.s3_config())
    for key in storage.list_keys():                       # a lifecycle rule empties it
        client.delete(storage.namespace + key)
    request = second.add("b", tokens + [5])
    second.run()
    assert request.loaded == 5 and second.invalid_seen      # promised, failed, recomputed
    assert second.scheduler.counters.blocks_load_failed == 5
    # dropped from the catalog, recomputed, and stored again: the store heals
    assert set(hash_blocks(tokens, BS)[1]) <= second.scheduler.planner.registry.hashes_in("G4")
    assert len(storage.list_keys()) >= 5
    assert_idle(second)
    _shutdown(second)


@pytest.mark.parametrize("slow", [True, False], ids=["slow-link", "direct"])
def test_a_bucket_behind_a_slow_link_is_recomputed_a_direct_one_loaded(tmp_path, store, weed,
                                                                        slow):
    """The cost model learns G4's speed from the engine's own stores (no G4 read measured
    yet): behind a link adding 0.6 s per request it recomputes what G4 holds; reached
    directly, it loads it. The prefill rate is set so recomputing takes 0.2 s."""
    from kvstrata.testing.slowlink import SlowLink

    url, tenant = store
    link = SlowLink(("127.0.0.1", weed.s3_port), latency=0.6, bytes_per_s=1e6) if slow \
        else None
    try:
        if link is not None:
            url = f"{link.endpoint}/{weed.bucket}"
        sim = SimEngine(tmp_path, ranks=1, block_size=BS, extra={
            "tiers": {"G2": {"blocks": 12}, "G4": {"blocks": 512, "url": url}},
            "list_interval": 3600, "tenant": tenant, "cost_aware": True})
        tokens = prompt(63, 8 * BS + 1)
        sim.add("a", tokens)
        sim.run()
        for i in range(2):                              # push its blocks out of G2
            sim.add(f"x{i}", prompt(64 + i, 8 * BS + 1))
            sim.run()
        held = sim.scheduler.planner.lookup(hash_blocks(tokens, BS)[1][:8])
        assert held == ["G4"] * 8
        costs = sim.scheduler.planner.costs
        assert costs.snapshot()["paths"]["G2->G4"]["samples"] >= 1
        costs.assume_prefill(8 * BS / 0.2)
        if slow:
            request = sim.add("b", tokens + [5])
            sim.step()
            assert request.loaded == 0
            assert sim.scheduler.counters.tokens_not_loaded == {"G4": 8 * BS}
            sim.run()
        else:
            run_and_check_load(sim, "b", tokens + [5], expect_blocks=8)
            assert sim.scheduler.counters.blocks_loaded == {"G4": 8}
        assert_idle(sim)
        _shutdown(sim)
    finally:
        if link is not None:
            link.close()


class _TimedForwardSim(SimEngine):
    """A simulator whose forwards with work take ``forward_s`` and are recorded, so a test
    can see when each G4 PUT began against the forwards."""

    forward_s = 0.6

    def _forward(self, rank, scheduled):
        super()._forward(rank, scheduled)
        if scheduled:
            began = time.monotonic()
            time.sleep(self.forward_s)
            self.forwards.append((began, time.monotonic()))


def _puts_during_forwards(tmp_path, store, yield_to_forward):
    url, tenant = store
    sim = _TimedForwardSim(tmp_path, block_size=BS, extra={
        "tiers": {"G2": {"blocks": 16}, "G4": {"blocks": 512, "url": url}},
        "list_interval": 3600, "tenant": tenant, "yield_to_forward": yield_to_forward})
    sim.forwards = []
    objects = sim.workers[0].storages.by_tier["G4"]
    objects.max_concurrency = 1      # one PUT after another (set before its pool exists)
    began: list[float] = []
    real_put = objects.client.put_if_absent

    def slow_recording_put(key, body):   # a store 0.1 s away: a plan's PUTs spread out
        began.append(time.monotonic())
        time.sleep(0.1)
        return real_put(key, body)

    objects.client.put_if_absent = slow_recording_put
    sim.add("a", prompt(71, 6 * BS + 1), max_new=2)
    sim.run()
    # its 4 blocks go to G4 during its decode forwards (unpaced: 2 of them well inside one)
    sim.add("b", prompt(72, 4 * BS + 1), max_new=6)
    sim.run()
    grace = 0.2        # a PUT that passed the gate just before a forward may begin in it
    inside = [t for t in began for f0, f1 in sim.forwards if f0 + grace < t < f1]
    held = dict(sim.scheduler.counters.writes_held_seconds)
    in_g4 = sim.scheduler.planner.pools["G4"].status().inactive
    _shutdown(sim)
    return began, inside, held, in_g4


@pytest.mark.parametrize("yield_to_forward", ["auto", False])
def test_uploads_to_g4_wait_for_the_forward_on_a_cpu_engine(tmp_path, store,
                                                            yield_to_forward):
    began, inside, held, in_g4 = _puts_during_forwards(tmp_path, store, yield_to_forward)
    assert len(began) >= 10 and in_g4 >= 10          # every full block still reached G4
    if yield_to_forward == "auto":                   # G1 is host memory here: paced
        assert inside == [] and held.get("G4", 0) > 0
    else:                                            # the control: PUTs run in forwards
        assert inside and not held
