"""The connector over a durable G3: a restarted engine (new scheduler and workers on the same
disk directory) loads the prefixes the last one stored, byte-exact, on every rank; a block one
rank lost is a miss for all of them."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from kvstrata.physical.storage.disk_index import DiskIndex  # noqa: E402
from kvstrata.tokens import hash_blocks  # noqa: E402

from .sim import SimEngine, assert_idle  # noqa: E402
from .test_halves import BS, prompt, run_and_check_load  # noqa: E402


def _first_run(tmp_path, tokens, ranks=1):
    sim = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=ranks, block_size=BS)
    sim.add("a", tokens)
    sim.run()
    for worker in sim.workers:
        worker.shutdown()


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_restarted_engine_loads_what_the_last_one_stored(tmp_path, ranks):
    tokens = prompt(41, 8 * BS + 1)
    _first_run(tmp_path, tokens, ranks)
    sim = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=ranks, block_size=BS)
    # known from the workers' index files before the first step, and announced to vLLM
    assert sorted(sim.scheduler.planner.registry.hashes_in("G3")) == \
        sorted(hash_blocks(tokens, BS)[1])
    stored = [e for e in sim.scheduler.events.take() if type(e).__name__ == "BlockStored"]
    assert sorted(h for e in stored for h in e.block_hashes) == sorted(hash_blocks(tokens, BS)[1])
    assert {e.medium for e in stored} == {"STORAGE"}
    run_and_check_load(sim, "b", tokens + [5], expect_blocks=8)
    assert sim.scheduler.counters.blocks_loaded == {"G3": 8}
    assert_idle(sim)
    for worker in sim.workers:
        worker.shutdown()


def test_a_block_one_rank_lost_is_a_miss_for_all(tmp_path):
    tokens = prompt(42, 6 * BS + 1)
    fourth = hash_blocks(tokens, BS)[1][3]
    sim = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=2, block_size=BS)
    sim.add("a", tokens)
    sim.run()
    index = sim.workers[1].storages.by_tier["G3"].index
    where = dict(path=index.path, capacity=index.capacity, fingerprint=index.fingerprint,
                 stride=index.stride, key_id=index.key_id)
    for worker in sim.workers:
        worker.shutdown()
    # rank 1 lost the index entry of the fourth block (killed between its write and entry)
    index = DiskIndex.open(**where)
    index.free([e.slot for e in index.entries() if e.sequence_hash == fourth])
    index.close()
    sim = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=2, block_size=BS)
    held = sim.scheduler.planner.registry.hashes_in("G3")
    assert len(held) == 5 and fourth not in held
    run_and_check_load(sim, "b", tokens + [5], expect_blocks=3)    # the prefix before it
    assert_idle(sim)
    for worker in sim.workers:
        worker.shutdown()


def test_without_readable_index_files_the_workers_first_reports_restore(tmp_path, monkeypatch):
    """A scheduler on another machine than its workers learns what they kept from their
    first reports (a step later)."""
    import kvstrata.connectors.vllm.scheduler as scheduler_module

    tokens = prompt(43, 5 * BS + 1)
    _first_run(tmp_path, tokens, ranks=2)
    monkeypatch.setattr(scheduler_module, "peek_recovered", lambda *a, **k: None)
    sim = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=2, block_size=BS)
    assert not sim.scheduler.planner.registry.hashes_in("G3")
    sim.step()
    assert sorted(sim.scheduler.planner.registry.hashes_in("G3")) == \
        sorted(hash_blocks(tokens, BS)[1])
    run_and_check_load(sim, "b", tokens + [5], expect_blocks=5)
    assert_idle(sim)
    for worker in sim.workers:
        worker.shutdown()


def test_a_restart_counts_its_own_kept_slab_as_free_space(tmp_path, monkeypatch):
    """A disk tier that fills most of its disk must start again: its slab is reused."""
    import kvstrata.kinds.disk as settings_module   # where the disk tier checks its space
    from kvstrata.compat import compatibility_of
    from kvstrata.connectors.vllm.settings import (ConnectorConfigError, KvGeometry,
                                                   settings_from)
    from kvstrata.physical.storage.disk_home import home_name

    geometry = KvGeometry(BS, 2, 2, 8, "bfloat16", 64)
    extra = {"tiers": {"G2": {"blocks": 16}, "G3": {"blocks": 1000}},
             "disk_dir": str(tmp_path)}
    from kvstrata.kinds.base import layout_config_for
    from kvstrata.physical.storage.disk import slab_stride

    kv = settings_from(extra, geometry, env={}).kv
    need = 1000 * slab_stride(layout_config_for(kv, 1))     # the slab of 1,000 blocks
    monkeypatch.setattr(settings_module, "free_disk_bytes", lambda d: need // 10)
    with pytest.raises(ConnectorConfigError, match="G3 needs"):
        settings_from(extra, geometry, env={})
    monkeypatch.setattr(settings_module, "free_disk_bytes", lambda d: None)
    kv = settings_from(extra, geometry, env={}).kv
    fingerprint = compatibility_of(kv, block_layout="vllm").fingerprint
    home = tmp_path / home_name("G3", 0, fingerprint)
    home.mkdir()
    with open(home / "slab", "wb") as fh:                # what the last run left
        fh.truncate(need)
    monkeypatch.setattr(settings_module, "free_disk_bytes", lambda d: need // 10)
    settings_from(extra, geometry, env={})               # no error: the slab is reused


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_reset_cache_is_for_good_across_a_restart(tmp_path, ranks):
    """vLLM's reset_prefix_cache (e.g. after new weights) reaches the workers' durable G3:
    a restarted engine recovers nothing that was dropped, yet keeps what was stored after
    the reset, in the very slots the reset freed."""
    old, new = prompt(44, 6 * BS + 1), prompt(45, 3 * BS + 1)
    sim = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=ranks, block_size=BS)
    sim.add("a", old)
    sim.run()
    g3 = sim.scheduler.planner.pools["G3"]
    freed = sorted(g3.lookup(h).block_id for h in hash_blocks(old, BS)[1])
    assert sim.scheduler.reset_cache() is True
    sim.add("b", new)                        # the reset travels with this step's orders
    sim.run()
    reused = sorted(g3.lookup(h).block_id for h in hash_blocks(new, BS)[1])
    assert set(reused) <= set(freed)         # the new blocks took freed slots
    for worker in sim.workers:
        worker.shutdown()
    _a_restart_serves_only(tmp_path, new, ranks)


def test_a_reset_of_an_idle_engine_keeps_it_stepping_until_the_workers_forgot(tmp_path):
    """vLLM steps an idle engine only while its connector has pending work: a reset that
    only queued the workers' orders was never journaled, and a restart with new weights
    served the old KV."""
    old, new = prompt(46, 6 * BS + 1), prompt(47, 3 * BS + 1)
    sim = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS)
    sim.add("a", old)
    sim.run()
    sim.add("b", new)
    sim.run()
    assert not sim.scheduler.has_pending_work()
    assert sim.scheduler.reset_cache() is True
    assert sim.scheduler.has_pending_work()     # the orders are still to go: keep stepping
    steps = sim.steps
    while sim.scheduler.has_pending_work():      # what vLLM's engine loop does when idle
        assert sim.steps - steps < 100, "the reset never left"
        sim.step()
    sim.run()
    for worker in sim.workers:
        worker.shutdown()
    _a_restart_serves_only(tmp_path, [], 1)             # neither prompt comes back


def test_a_reset_with_copies_in_flight_loads_nothing_old_and_drops_it_when_they_end(
        tmp_path):
    """A reset was refused while any copy was in flight, and nothing else happened: under
    load (an RL loop syncing weights right after a rollout, its stores still draining) that
    was always, and the old KV kept being loaded. It still says False until it is done, but
    from then on nothing loads, nothing new is stored, and the drop is made once the copies
    end, whether or not the caller asks again."""
    old = prompt(48, 6 * BS + 1)
    sim = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS)
    sim.add("warm", prompt(49, 2 * BS + 1))
    sim.run()
    sim.add("a", old)
    for _ in range(100):                          # until its stores are on their way
        sim.step()
        if not sim.scheduler.planner.idle:
            break
    assert not sim.scheduler.planner.idle
    assert sim.scheduler.reset_cache() is False   # not done yet: under way
    asking = sim.add("again", old)
    assert sim.scheduler.get_num_new_matched_tokens(asking, 0)[0] == 0   # nothing old loads
    sim.scheduler.request_finished(sim.requests.pop("again"), [])
    sim.run()                                     # the copies end
    deadline = time.monotonic() + 60              # a hang guard, not a timing claim
    while sim.scheduler.has_pending_work():       # what vLLM's engine loop does when idle
        assert time.monotonic() < deadline, "the reset never finished"
        sim.step()
        time.sleep(0.001)
    sim.run()
    assert all(not sim.scheduler.registry.hashes_in(t) for t in ("G2", "G3"))
    assert sim.scheduler.reset_cache() is True    # asked again: done (nothing left to drop)
    for worker in sim.workers:
        worker.shutdown()
    _a_restart_serves_only(tmp_path, [], 1)


def test_a_reset_before_the_workers_report_what_they_kept_drops_that_too(tmp_path,
                                                                         monkeypatch):
    """A scheduler that cannot read the workers' index files learns what they kept from
    their first reports; a reset_cache before those reports must not bring it back then,
    nor after another restart."""
    import kvstrata.connectors.vllm.scheduler as scheduler_module

    old, new = prompt(46, 5 * BS + 1), prompt(47, 3 * BS + 1)
    _first_run(tmp_path, old, ranks=2)
    with monkeypatch.context() as patch:
        patch.setattr(scheduler_module, "peek_recovered", lambda *a, **k: None)
        sim = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=2, block_size=BS)
        assert sim.scheduler.reset_cache() is True     # before any report
        sim.add("b", new)
        sim.run()
        held = sim.scheduler.planner.registry.hashes_in("G3")
        assert not held & set(hash_blocks(old, BS)[1])
        assert held == set(hash_blocks(new, BS)[1])
        for worker in sim.workers:
            worker.shutdown()
    _a_restart_serves_only(tmp_path, new, ranks=2)


def _a_restart_serves_only(tmp_path, tokens, ranks):
    """A restarted engine holds exactly ``tokens``' full blocks in G3 and loads them."""
    sim = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=ranks, block_size=BS)
    held = hash_blocks(tokens, BS)[1]
    assert sorted(sim.scheduler.planner.registry.hashes_in("G3")) == sorted(held)
    run_and_check_load(sim, "c", tokens + [5], expect_blocks=len(held))
    assert_idle(sim)
    for worker in sim.workers:
        worker.shutdown()
