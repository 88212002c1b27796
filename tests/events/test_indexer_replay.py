"""After replaying the shipped trace, the indexer's view equals the manager's registry."""

import pytest

from kvstrata.config import KvConfig, load_config, normalize_tiers
from kvstrata.events import EventPublisher, StreamFollower
from kvstrata.events.indexer import PrefixIndex
from kvstrata.events.sinks import CallbackSink
from kvstrata.replay import load_trace, replay


def _replay_into_index(requests, config, granularity):
    index = PrefixIndex()
    follower = StreamFollower(index)
    publisher = EventPublisher(CallbackSink(follower.feed_batch), worker_id=11).start()
    result = replay(requests, config, granularity=granularity, observers=[publisher])
    assert publisher.flush(60)
    publisher.close()
    metrics = publisher.metrics()
    assert metrics["dropped"] == 0 and metrics["published"] == metrics["enqueued"] > 0
    assert follower.stats()["gaps"] == 0
    return index, result.registry


def _assert_same(index, registry):
    for tier in ("G1", "G2", "G3", "G4"):
        assert index.hashes_in(11, tier) == registry.hashes_in(tier), tier
    assert index.compare_with_registry(registry, 11) == {}


def test_indexer_equals_registry_after_engine_granularity_replay():
    config = KvConfig(tiers=normalize_tiers({"G1": 2000, "G2": 4000}))
    index, registry = _replay_into_index(load_trace()[:250], config, "engine")
    _assert_same(index, registry)
    assert registry.hashes_in("G1") and registry.hashes_in("G2")


@pytest.mark.slow
def test_indexer_equals_registry_after_the_whole_shipped_trace():
    """All 12,031 requests through the default G1/G2/G3 hierarchy (trace granularity)."""
    index, registry = _replay_into_index(load_trace(), load_config(env={}), "trace")
    _assert_same(index, registry)
    assert all(registry.hashes_in(t) for t in ("G1", "G2", "G3"))
