"""The replay's events reach a real NATS server and files, and rebuild the registry's state."""

from __future__ import annotations

import json
import uuid

import pytest

from kvstrata.cli import main as cli_main
from kvstrata.config import load_config
from kvstrata.events import WorkerStates, make_publisher
from kvstrata.events.subscriber import NatsFollower
from kvstrata.replay import load_trace, replay

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("fmt", ["kvstrata", "dynamo"])
def test_replay_events_over_nats_rebuild_every_tier(nats_server, fmt):
    subj = f"kvreplay.{uuid.uuid4().hex[:10]}"
    target = WorkerStates()
    with NatsFollower(nats_server.url, subj, target, format=fmt) as follower:
        publisher = make_publisher(f"{nats_server.url}/{subj}?format={fmt}", worker_id=5)
        assert follower.wait_for(lambda: publisher.sink.connected, 5)
        result = replay(load_trace()[:1500], load_config(env={}), granularity="trace",
                        observers=[publisher])
        assert publisher.flush(30)
        last = publisher.last_event_id
        assert follower.wait_for(lambda: follower.follower.last_event_id(5) == last, 30)
        publisher.close()
        assert publisher.metrics()["dropped"] == 0
        stats = follower.follower.stats()
        assert stats["gaps"] == 0 and stats["duplicates"] == 0
        for tier in ("G1", "G2", "G3"):
            held = result.registry.hashes_in(tier)
            assert held and target.hashes(5).get(tier, set()) == held, tier


def test_cli_replay_to_dynamo_file_then_indexer_query(tmp_path, capsys):
    events = tmp_path / "events.jsonl"
    assert cli_main(["replay", "--limit", "300", "--tiers", "G1=200,G2=800",
                     "--events", f"dynamo-json:{events}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["events"]["published"] == report["events"]["enqueued"] > 0
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert lines and all({"worker_id", "storage_tier", "event"} <= set(line) for line in lines)
    ids = [line["event"]["event_id"] for line in lines]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # The first stored chain of the file is a prefix the indexer must report as cached.
    first = next(l["event"]["data"]["stored"] for l in lines if "stored" in l["event"]["data"])
    hashes = [b["block_hash"] for b in first["blocks"]]
    assert cli_main(["indexer", "--file", str(events), "--query", ",".join(map(str, hashes[:3]))]) == 0
    answer = json.loads(capsys.readouterr().out)
    # The trace's first block (id 0) opens every request, so it is still cached in G1.
    assert answer["length"] == 3 and answer["best"]["tier"] == "G1" and answer["best"]["prefix"] >= 1
