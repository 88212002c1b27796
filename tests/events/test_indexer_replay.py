"""After replaying the shipped trace, the indexer's view equals the manager's registry."""

import importlib

import pytest

from kvstrata.events import EventPublisher, StreamFollower
from kvstrata.events.indexer import PrefixIndex
from kvstrata.events.sinks import CallbackSink


def _replay_api():
    try:
        replay_mod = importlib.import_module("kvstrata.replay")
        config_mod = importlib.import_module("kvstrata.config")
    except ImportError as exc:
        pytest.skip(f"kvstrata.replay not available yet: {exc}")
    if not all(hasattr(replay_mod, n) for n in ("load_trace", "replay")) or not hasattr(config_mod, "KvConfig"):
        pytest.skip("kvstrata.replay.load_trace/replay or kvstrata.config.KvConfig not available yet")
    return replay_mod, config_mod


def _config(config_mod, tiers):
    if hasattr(config_mod, "normalize_tiers"):
        return config_mod.KvConfig(tiers=config_mod.normalize_tiers(tiers))
    return config_mod.KvConfig(tiers=tiers)


@pytest.mark.parametrize("requests", [250])
def test_indexer_equals_registry_after_trace_replay(requests):
    replay_mod, config_mod = _replay_api()
    trace = replay_mod.load_trace()[:requests]
    index = PrefixIndex()
    follower = StreamFollower(index)
    publisher = EventPublisher(CallbackSink(follower.feed_batch), worker_id=11).start()
    result = replay_mod.replay(trace, _config(config_mod, {"G1": 2000, "G2": 4000}), observers=[publisher])
    assert publisher.flush(30)
    publisher.close()
    metrics = publisher.metrics()
    assert metrics["dropped"] == 0 and metrics["published"] == metrics["enqueued"] > 0
    registry = result.registry
    assert follower.stats()["gaps"] == 0
    for tier in ("G1", "G2", "G3", "G4"):
        assert index.hashes_in(11, tier) == registry.hashes_in(tier), tier
    assert index.compare_with_registry(registry, 11) == {}
    assert len(registry.hashes_in("G1")) > 0 and len(registry.hashes_in("G2")) > 0
