"""Transfer plans and results: validation and serialization (the torch-free protocol)."""

from __future__ import annotations

import json

import pytest

from kvstrata.protocol import (BlockFailure, Endpoint, FailureKind, TransferPlan,
                               TransferPlanError, TransferResult)


def _plan(**kw):
    args = dict(job_id=3, source=Endpoint("G1"), target=Endpoint("G2"),
                sequence_hashes=[2**64 - 1, 7], src_block_ids=[1, 2], dst_block_ids=[5, 6])
    args.update(kw)
    return TransferPlan(**args)


def test_plan_round_trip_through_json():
    plan = _plan()
    again = TransferPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.src_tier == "G1" and again.dst_tier == "G2"
    assert again.path == "G1->G2" and again.job_id == 3
    assert TransferPlan.for_path("G1->G2", [1, 2], [5, 6], [2**64 - 1, 7], job_id=3) == plan


def test_key_addressed_tiers_carry_keys_and_round_trip():
    plan = _plan(target=Endpoint("G4", worker=2), dst_block_ids=(), dst_keys=["a/1", "a/2"])
    assert plan.dst_keys == ("a/1", "a/2") and plan.target.worker == 2
    assert TransferPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    with pytest.raises(TransferPlanError, match="addressed by keys: dst_block_ids must be empty"):
        _plan(target=Endpoint("G4"), dst_keys=["a", "b"])
    with pytest.raises(TransferPlanError, match="lengths differ: 2 sequence hashes, 0 dst_keys"):
        _plan(target=Endpoint("G4"), dst_block_ids=())
    with pytest.raises(TransferPlanError, match="non-empty string"):
        _plan(target=Endpoint("G4"), dst_block_ids=(), dst_keys=["a", ""])
    with pytest.raises(TransferPlanError, match="dst_keys contains duplicates"):
        _plan(target=Endpoint("G4"), dst_block_ids=(), dst_keys=["a", "a"])
    with pytest.raises(TransferPlanError, match="addressed by slots: src_keys must be empty"):
        _plan(src_keys=["x", "y"])


@pytest.mark.parametrize("change,match", [
    ({"source": {"tier": "g1", "worker": 0}}, "unknown tier"),
    ({"target": {"tier": "G9", "worker": 0}}, "unknown tier"),
    ({"target": {"tier": "G1", "worker": 0}}, "same endpoint"),
    ({"target": {"tier": "G2", "worker": -1}}, "worker"),
    ({"target": {"tier": "G2"}}, "target must be"),
    ({"src_block_ids": []}, "lengths differ"),
    ({"sequence_hashes": [], "src_block_ids": [], "dst_block_ids": []}, "at least one"),
    ({"src_block_ids": [1]}, "lengths differ"),
    ({"src_block_ids": [1, -2]}, "out of range"),
    ({"src_block_ids": [1, True]}, "must be an int"),
    ({"dst_block_ids": [5, 5]}, "duplicates"),
    ({"dst_block_ids": "56"}, "list of ints"),
    ({"sequence_hashes": [2**64, 1]}, "out of range"),
    ({"sequence_hashes": [1.0, 2]}, "must be an int"),
    ({"job_id": "x"}, "job_id"),
    ({"job_id": None}, "job_id"),
    ({"job_id": -1}, "job_id"),
    ({"version": 2}, "version"),
])
def test_malformed_plans_rejected(change, match):
    data = {**_plan().to_dict(), **change}
    with pytest.raises(TransferPlanError, match=match):
        TransferPlan.from_dict(data)


@pytest.mark.parametrize("data,match", [
    ([1, 2], "must be a dict"),
    ({"version": 1, "source": {"tier": "G1", "worker": 0}}, "missing keys"),
    ({k: v for k, v in _plan().to_dict().items() if k != "job_id"}, r"missing keys \['job_id'\]"),
    ({**_plan().to_dict(), "priority": 1}, "unknown keys"),
])
def test_malformed_plan_dicts_rejected(data, match):
    with pytest.raises(TransferPlanError, match=match):
        TransferPlan.from_dict(data)


def test_for_path_refuses_unknown_paths():
    with pytest.raises(TransferPlanError, match="path looks like"):
        TransferPlan.for_path("G1G2", [1], [2], [3], job_id=1)
    with pytest.raises(TransferPlanError, match="unknown tier"):
        TransferPlan.for_path("G1->X", [1], [2], [3], job_id=1)


def test_result_round_trip_and_helpers():
    plan = _plan()
    result = TransferResult(plan, (True, False), (123, None), 4096, 0.5,
                            (BlockFailure(1, 6, FailureKind.DISK_FULL, "ENOSPC"),))
    again = TransferResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again == result and again.job_id == 3
    assert again.failed_sequence_hashes == (7,) and again.ok_dst_block_ids == (5,)
    assert not again.all_ok
    bad = result.to_dict()
    bad["ok"] = [True]
    with pytest.raises(TransferPlanError, match="lengths"):
        TransferResult.from_dict(bad)
    bad = result.to_dict()
    bad["failures"] = [{"position": 0}]
    with pytest.raises(TransferPlanError):
        TransferResult.from_dict(bad)
    bad = result.to_dict()
    bad["failures"][0]["position"] = 0           # names a block that arrived
    with pytest.raises(TransferPlanError, match="position"):
        TransferResult.from_dict(bad)
    bad = result.to_dict()
    bad["ok"] = [1, 0]
    with pytest.raises(TransferPlanError, match="booleans"):
        TransferResult.from_dict(bad)


def test_success_and_failed_results_cover_the_plan():
    plan = _plan()
    assert TransferResult.success(plan).all_ok
    failed = TransferResult.failed(plan, FailureKind.INTERNAL, "never ran")
    assert failed.ok == (False, False) and failed.failed_sequence_hashes == plan.sequence_hashes
    assert [f.position for f in failed.failures] == [0, 1] and failed.error == "never ran"
    assert FailureKind.CHECKSUM_MISMATCH.bad_source and not FailureKind.DISK_FULL.bad_source
