"""Transfer plans and results: validation and serialization."""

from __future__ import annotations

import json

import pytest

from kvstrata.physical import (BlockFailure, FailureKind, TransferPlan, TransferPlanError,
                               TransferResult)


def _plan(**kw):
    args = dict(path="G1->G2", src_block_ids=[1, 2], dst_block_ids=[5, 6],
                sequence_hashes=[2**64 - 1, 7], plan_id=3)
    args.update(kw)
    return TransferPlan(**args)


def test_plan_round_trip_through_json():
    plan = _plan()
    again = TransferPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.src_tier == "G1" and again.dst_tier == "G2"
    assert TransferPlan.from_dict({k: v for k, v in plan.to_dict().items()
                                   if k != "plan_id"}).plan_id is None


@pytest.mark.parametrize("change,match", [
    ({"path": "G1->G3"}, "path"),
    ({"path": "g1->g2"}, "path"),
    ({"src_block_ids": []}, "at least one"),
    ({"src_block_ids": [1]}, "lengths differ"),
    ({"src_block_ids": [1, -2]}, "out of range"),
    ({"src_block_ids": [1, True]}, "must be an int"),
    ({"dst_block_ids": [5, 5]}, "duplicates"),
    ({"dst_block_ids": "56"}, "list of ints"),
    ({"sequence_hashes": [2**64, 1]}, "out of range"),
    ({"sequence_hashes": [1.0, 2]}, "must be an int"),
    ({"plan_id": "x"}, "plan_id"),
])
def test_malformed_plans_rejected(change, match):
    data = {**_plan().to_dict(), **change}
    with pytest.raises(TransferPlanError, match=match):
        TransferPlan.from_dict(data)


@pytest.mark.parametrize("data,match", [
    ([1, 2], "must be a dict"),
    ({"path": "G1->G2"}, "missing keys"),
    ({**_plan().to_dict(), "priority": 1}, "unknown keys"),
])
def test_malformed_plan_dicts_rejected(data, match):
    with pytest.raises(TransferPlanError, match=match):
        TransferPlan.from_dict(data)


def test_result_round_trip_and_helpers():
    plan = _plan()
    result = TransferResult(plan, (True, False), (123, None), 4096, 0.5,
                            (BlockFailure(1, 6, FailureKind.DISK_FULL, "ENOSPC"),))
    again = TransferResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again == result
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
