"""Hostile tests of yield_to_forward through the connector halves: shutdown while writes are
held by a forward that never ended, shutdown twice, held time across tensor-parallel ranks and
through the worker report, and what the scheduler counts as held."""

from __future__ import annotations

import pickle
import time

import pytest

pytest.importorskip("vllm")

from kvstrata.connectors.vllm.settings import (ConnectorConfigError, KvGeometry,  # noqa: E402
                                               settings_from)
from kvstrata.connectors.vllm.metadata import (RankResults, StepOrders,  # noqa: E402
                                               WorkerReport)
from kvstrata.protocol import Endpoint  # noqa: E402
from kvstrata.protocol.plans import TransferPlan  # noqa: E402
from kvstrata.protocol.results import TransferResult  # noqa: E402

from .sim import SimEngine, _ConnectorOutput, sim_factory  # noqa: E402

pytestmark = pytest.mark.timeout(60)

BS = 4


@pytest.fixture
def make(tmp_path):
    yield from sim_factory(SimEngine, tmp_path, BS)


def _g2_to_g3(job: int) -> TransferPlan:
    return TransferPlan(job, Endpoint("G2"), Endpoint("G3"), (4242,),
                        src_block_ids=(0,), dst_block_ids=(63,))


def test_shutdown_releases_writes_held_by_a_forward_that_never_ended_and_runs_twice(make):
    sim = make(extra={"yield_to_forward": True})
    worker = sim.workers[0]
    assert worker.pacer is not None and worker.pacer.max_hold >= 2.0
    # the step's orders arrive (the forward begins) and the forward never returns
    worker.start(StepOrders(plans=[_g2_to_g3(9001)]))
    assert worker.pacer.forward_running
    time.sleep(0.1)
    assert 9001 in worker._outstanding                # held at the gate
    began = time.monotonic()
    worker.shutdown()
    assert time.monotonic() - began < worker.pacer.max_hold - 1.0
    assert worker._outstanding == set()
    assert any(r.plan.job_id == 9001 for _, r in worker._reported)   # it ran, and reported
    worker.shutdown()                                 # twice: nothing left to do
    assert worker.engine is None and worker.storages is None
    worker.pacer.forward_started()
    assert worker.pacer.wait() == 0.0


def test_held_time_of_results_the_planner_refuses_is_not_counted(make):
    """The scheduler adds each combined result's held_seconds to writes_held_seconds before
    the planner checks the result: a stale, duplicated or unknown result inflates the
    metric though the planner refuses it."""
    sim = make(extra={"yield_to_forward": True})
    plan = _g2_to_g3(987_654)                         # no such plan was handed out
    result = TransferResult(plan, (True,), (None,), 128, 0.01, held_seconds=5.0)
    sim.scheduler.update_connector_output(
        _ConnectorOutput(kv_connector_worker_meta=WorkerReport([(0, result)])))
    assert sim.scheduler.counters.writes_held_seconds.get("G3", 0.0) == 0.0


def test_held_time_across_ranks_is_the_longest_and_survives_the_report():
    plan = _g2_to_g3(5)
    ranks = RankResults(2)
    r0 = TransferResult(plan, (True,), (None,), 64, 0.2, held_seconds=1.0)
    r1 = TransferResult(plan, (True,), (None,), 64, 0.1, held_seconds=3.0)
    report = pickle.loads(pickle.dumps(WorkerReport([(0, r0)]).aggregate(
        WorkerReport([(1, r1)]))))
    assert [r.held_seconds for _, r in report.results] == [1.0, 3.0]
    assert ranks.add(0, report.results[0][1]) is None
    combined = ranks.add(1, report.results[1][1])
    assert combined.held_seconds == 3.0 and combined.seconds == 0.2
    assert TransferResult.from_dict(combined.to_dict()).held_seconds == 3.0


def test_a_paced_cpu_engine_counts_held_writes_once_per_plan_with_two_ranks(make):
    sim = make(ranks=2, extra={"yield_to_forward": True})
    assert all(w.pacer is not None for w in sim.workers)
    for i in range(3):
        sim.add(f"r{i}", [(i * 131 + j * 7) % 5000 + 3 for j in range(6 * BS + 1)])
    sim.run()
    held = sim.scheduler.counters.writes_held_seconds
    assert set(held) <= {"G3"} and all(v >= 0.0 for v in held.values())
    for worker in sim.workers:
        assert not worker.pacer.forward_running
        c = worker.pacer.counters
        assert c.forwards == sim.steps and c.overruns == 0


GEOMETRY = KvGeometry(BS, 2, 2, 8, "bfloat16", 64)


@pytest.mark.parametrize("value", [0, 1, "true", "false", "Auto", "auto ", "", [], {}])
def test_yield_to_forward_other_spellings_are_refused(value):
    with pytest.raises(ConnectorConfigError, match="yield_to_forward"):
        settings_from({"yield_to_forward": value}, GEOMETRY, env={})
