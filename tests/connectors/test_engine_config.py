"""The extra-config keys both engine connectors read (kvstrata.connectors.engine_config) are
refused alike by vLLM's connector and SGLang's HiCache backend: one line naming the key, for
each bad value, before anything is built."""

from __future__ import annotations

import pytest

from kvstrata.config import TierConfig
from kvstrata.connectors import engine_config

BAD = [
    ({"tiers": 5}, "tiers must be a mapping"),
    ({"tiers": {"G1": 10, "G3": "1GiB"}}, "tiers: G1 is"),
    ({"tiers": {}}, "tiers: name at least one tier under"),
    ({"tiers": "G3=abc"}, "tiers: tier G3: not a size"),
    ({"eviction": 3}, "eviction must be a non-empty string"),
    ({"admission": ""}, "admission must be a non-empty string"),
    ({"disk_dir": ["/tmp"]}, "disk_dir must be a non-empty string"),
    ({"tenant": 7}, "tenant must be a string"),
    ({"tenant_quotas": ["salt:a"]}, "tenant_quotas must be a table of tenants"),
    ({"config": 1}, "config must be a path"),
    ({"worker_id": 2**70}, "worker_id must be an integer in 0..2^64-1"),
    ({"worker_id": True}, "worker_id must be an integer"),
    ({"events": 42}, "events"),
]


@pytest.mark.parametrize("extra, line", BAD)
def test_each_bad_value_is_one_problem_line(extra, line):
    problems: list[str] = []
    engine_config.lower_tiers(extra.get("tiers", {"G3": 8}), problems, "the engine's cache")
    engine_config.config_overrides(extra, problems)
    engine_config.config_path(extra, problems)
    engine_config.events(extra, problems)
    engine_config.worker_id(extra, problems)
    assert len(problems) == 1 and line in problems[0], problems


def test_good_values_pass_through():
    problems: list[str] = []
    extra = {"tiers": "G2=8,G3=16", "eviction": "lru", "admission": "adaptive",
             "disk_dir": "/d", "tenant": "salt:x", "tenant_quotas": {"salt:x": {"G2": "50%"}},
             "config": "/k.toml", "worker_id": 3, "events": ["jsonl:/tmp/e.jsonl"]}
    assert engine_config.lower_tiers(extra["tiers"], problems, "x") == \
        {"G2": TierConfig(blocks=8), "G3": TierConfig(blocks=16)}
    assert engine_config.config_overrides(extra, problems) == {
        k: extra[k] for k in engine_config.OVERRIDE_KEYS}
    assert engine_config.config_path(extra, problems) == "/k.toml"
    assert engine_config.worker_id(extra, problems) == 3
    assert engine_config.events(extra, problems) == ("jsonl:/tmp/e.jsonl",)
    assert problems == []


def _vllm(extra):
    pytest.importorskip("vllm")
    from kvstrata.connectors.vllm.settings import ConnectorConfigError, KvGeometry, settings_from
    with pytest.raises(ConnectorConfigError) as refused:
        settings_from(extra, KvGeometry(32, 2, 2, 8, "bfloat16", 64), env={})
    return str(refused.value)


def _sglang(extra):
    pytest.importorskip("sglang")
    from kvstrata.connectors.sglang.settings import SGLangConfigError, settings_from
    with pytest.raises(SGLangConfigError) as refused:
        settings_from({"interface_v1": 1, **extra})
    return str(refused.value)


@pytest.mark.parametrize("connector", [_vllm, _sglang])
@pytest.mark.parametrize("extra, line", BAD)
def test_both_connectors_refuse_the_same_values(connector, extra, line):
    message = connector(extra)
    assert "\n" not in message and line in message, message
