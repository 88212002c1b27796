"""vLLM's data parallelism: each data-parallel engine has its own scheduler and workers, so
its own G3 (``<directory>/dp<k>`` for engine ``k > 0``) and its own publisher id in
kvstrata's events, while its workers name their share of a block by their rank in the
engine, as the same rank of any other engine does (one fingerprint: G4 is shared)."""

from __future__ import annotations

import os
import types

import pytest

pytest.importorskip("vllm")

from kvstrata.connectors.vllm.connector import _worker_rank  # noqa: E402
from kvstrata.connectors.vllm.settings import ConnectorConfigError  # noqa: E402
from kvstrata.tokens import hash_blocks  # noqa: E402

from .sim import SimEngine, assert_idle  # noqa: E402
from .test_halves import BS, prompt, run_and_check_load  # noqa: E402


def test_a_worker_is_named_by_its_rank_in_its_engine_not_across_engines(monkeypatch):
    """vLLM's world group spans the data-parallel engines: engine 1's first worker of two
    is rank 2 there, and rank 0 in its engine."""
    import vllm.distributed.parallel_state as parallel_state

    for across, world_size, in_engine in ((0, 2, 0), (1, 2, 1), (2, 2, 0), (3, 2, 1),
                                          (5, 4, 1), (3, 1, 0)):
        monkeypatch.setattr(parallel_state, "get_world_group",
                            lambda r=across: types.SimpleNamespace(rank_in_group=r))
        assert _worker_rank(world_size) == in_engine


def _engine(tmp_path, index, engines=2, **extra):
    return SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=2, block_size=BS,
                     engine_index=index, engines=engines, extra=extra or None)


def test_each_engine_has_its_own_g3_and_publisher_id_and_one_fingerprint(tmp_path):
    first, second = _engine(tmp_path, 0), _engine(tmp_path, 1)
    assert first.settings.kv.disk_dir == str(tmp_path)
    assert second.settings.kv.disk_dir == os.path.join(str(tmp_path), "dp1")
    assert (first.settings.worker_id, second.settings.worker_id) == (0, 1)
    tokens = prompt(7, 6 * BS + 1)
    for engine in (first, second):
        engine.add("a", tokens)
        engine.run()
    homes = {engine: sorted(p.name for p in directory.iterdir() if p.name.startswith(
        "kvstrata-g3")) for engine, directory in ((0, tmp_path), (1, tmp_path / "dp1"))}
    assert len(homes[0]) == 2 and homes[0] == homes[1]      # same ranks, same fingerprint
    for engine in (first, second):
        assert_idle(engine)
        for worker in engine.workers:
            worker.shutdown()


def test_a_restarted_engine_restores_its_own_blocks_not_another_engines(tmp_path):
    ours, theirs = prompt(11, 6 * BS + 1), prompt(12, 6 * BS + 1)
    for index, tokens in ((0, theirs), (1, ours)):
        engine = _engine(tmp_path, index)
        engine.add("a", tokens)
        engine.run()
        for worker in engine.workers:
            worker.shutdown()
    again = _engine(tmp_path, 1)
    assert sorted(again.scheduler.planner.registry.hashes_in("G3")) == \
        sorted(hash_blocks(ours, BS)[1])
    run_and_check_load(again, "b", ours + [5], expect_blocks=6)
    assert_idle(again)
    for worker in again.workers:
        worker.shutdown()


def test_publisher_ids_stay_distinct_across_servers_and_in_range(tmp_path):
    ids = {(server, k): _engine(tmp_path / f"s{server}-{k}", k, engines=3,
                                worker_id=server).settings.worker_id
           for server in (0, 1) for k in range(3)}
    assert sorted(ids.values()) == list(range(6))
    with pytest.raises(ConnectorConfigError, match="below 2\\*\\*64"):
        _engine(tmp_path / "big", 1, engines=2, worker_id=(1 << 64) - 1)


def test_a_temporary_g3_stays_temporary_in_every_engine(tmp_path):
    engine = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS,
                       engine_index=1, engines=2, durable=False)
    assert engine.settings.kv.directory_of("G3") is None
    for worker in engine.workers:
        worker.shutdown()


def test_settings_without_data_parallelism_are_unchanged(tmp_path):
    plain = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS,
                      extra={"worker_id": 9})
    assert plain.settings.kv.disk_dir == str(tmp_path) and plain.settings.worker_id == 9
    for worker in plain.workers:
        worker.shutdown()
