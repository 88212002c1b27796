"""vLLM's data parallelism: each data-parallel engine has its own scheduler and workers, so
its own G3 (``<directory>/dp<k>`` for engine ``k > 0``) and events stamped with its rank
(files and bound endpoints of its own), while its workers name their share of a block by
their rank in the engine, as the same rank of any other engine does (one fingerprint: G4
is shared, see test_g4.py)."""

from __future__ import annotations

import os
import types

import pytest

pytest.importorskip("vllm")

from kvstrata.connectors.vllm.connector import _engine_index, _worker_rank  # noqa: E402
from kvstrata.connectors.vllm.settings import ConnectorConfigError  # noqa: E402
from kvstrata.events.spec import SinkSpecError, make_sink  # noqa: E402
from kvstrata.tokens import hash_blocks  # noqa: E402

from .sim import SimEngine, assert_idle  # noqa: E402
from .test_halves import BS, prompt, run_and_check_load  # noqa: E402


def test_a_worker_is_named_by_its_rank_in_its_engine_not_across_engines(monkeypatch):
    """vLLM's world group spans the data-parallel engines of a MoE model: engine 1's first
    worker of two is rank 2 there, and rank 0 in its engine."""
    import vllm.distributed.parallel_state as parallel_state

    for across, world_size, in_engine in ((0, 2, 0), (1, 2, 1), (2, 2, 0), (3, 2, 1),
                                          (5, 4, 1), (3, 1, 0)):
        monkeypatch.setattr(parallel_state, "get_world_group",
                            lambda r=across: types.SimpleNamespace(rank_in_group=r))
        assert _worker_rank(world_size) == in_engine


def test_the_engine_index_survives_vllms_reset_of_a_dense_models_engines():
    """vLLM runs the data-parallel engines of a dense model as independent engines of one
    rank each (data_parallel_rank reset to 0); data_parallel_index keeps the rank."""
    from vllm.config import ParallelConfig

    config = ParallelConfig(data_parallel_size=3, data_parallel_rank=2)
    assert _engine_index(config) == 2
    config.reconfigure_for_independent_dp_rank()
    assert config.data_parallel_rank == 0 and _engine_index(config) == 2
    assert _engine_index(ParallelConfig()) == 0


def _engine(tmp_path, index, **extra):
    return SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=2, block_size=BS,
                     engine_index=index, extra=extra or None)


def test_each_engine_has_its_own_g3_under_one_fingerprint(tmp_path):
    first, second = _engine(tmp_path, 0), _engine(tmp_path, 1)
    assert first.settings.kv.disk_dir == str(tmp_path)
    assert second.settings.kv.disk_dir == os.path.join(str(tmp_path), "dp1")
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


def test_a_temporary_g3_stays_temporary_in_every_engine(tmp_path):
    engine = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS,
                       engine_index=1, durable=False)
    assert engine.settings.kv.directory_of("G3") is None
    assert engine.settings.data_parallel_index == 1
    for worker in engine.workers:
        worker.shutdown()


def test_events_carry_the_engines_rank_in_files_and_endpoints_of_its_own(tmp_path):
    path = str(tmp_path / "events.jsonl")
    assert make_sink(f"jsonl:{path}").path == path
    engine1 = make_sink(f"jsonl:{path}", dp_rank=1)
    assert engine1.path == str(tmp_path / "events.dp1.jsonl") and engine1.dp_rank == 1
    assert make_sink("zmq://tcp://127.0.0.1:5557", dp_rank=2).endpoint == "tcp://127.0.0.1:5559"
    with pytest.raises(SinkSpecError, match="65535"):
        make_sink("zmq://tcp://127.0.0.1:65535", dp_rank=1)
    assert make_sink("zmq://ipc:///tmp/kv", dp_rank=1).endpoint == "ipc:///tmp/kv-dp1"
    # engines that connect to one collector all connect to it
    connected = make_sink("zmq://tcp://127.0.0.1:5557?connect=1", dp_rank=3)
    assert connected.endpoint == "tcp://127.0.0.1:5557" and connected.dp_rank == 3
    assert make_sink("zmq://tcp://127.0.0.1:5557").dp_rank == 0


def test_each_engine_exports_on_a_port_of_its_own(tmp_path):
    extra = {"export": "tcp://127.0.0.1:47000"}
    engines = [SimEngine(tmp_path / str(k), g2_blocks=16, g3_blocks=64, ranks=1,
                         block_size=BS, engine_index=k, extra=extra) for k in range(3)]
    assert [e.settings.export for e in engines] == [
        "tcp://127.0.0.1:47000", "tcp://127.0.0.1:47001", "tcp://127.0.0.1:47002"]
    for engine in engines:          # all three serve at once: no port taken twice
        for worker in engine.workers:
            worker.shutdown()
    with pytest.raises(ConnectorConfigError, match="above 65535"):
        SimEngine(tmp_path / "high", g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS,
                  engine_index=1, extra={"export": "tcp://127.0.0.1:65535"})


def test_an_engines_own_event_file_or_port_is_checked_with_the_settings(tmp_path):
    (tmp_path / "events.dp1.jsonl").mkdir()            # engine 1's file cannot be written
    for spec, words in ((f"jsonl:{tmp_path / 'events.jsonl'}", "events.dp1.jsonl"),
                        ("zmq://tcp://127.0.0.1:65535", "above 65535")):
        with pytest.raises(ConnectorConfigError, match="data-parallel engine 1"):
            SimEngine(tmp_path / "g", g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS,
                      engine_index=1, extra={"events": spec})
        with pytest.raises(ConnectorConfigError, match=words.replace(".", "\\.")):
            SimEngine(tmp_path / "g", g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS,
                      engine_index=1, extra={"events": spec})


def test_kvstrata_format_events_over_nats_are_refused_beyond_engine_0(tmp_path):
    """Engine 1 would publish as engine 0's worker on the same subject (the kvstrata format
    carries no engine rank): refused with the way out; the Dynamo format is fine."""
    nats = "nats://127.0.0.1:4222/kv.events"
    with pytest.raises(ConnectorConfigError, match="format=dynamo"):
        SimEngine(tmp_path / "a", g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS,
                  engine_index=1, extra={"events": nats})
    for index, spec in ((0, nats), (1, nats + "?format=dynamo")):
        settings = SimEngine(tmp_path / str(index), g2_blocks=16, g3_blocks=64, ranks=1,
                             block_size=BS, engine_index=index, extra={"events": spec})
        assert settings.settings.events == (spec,)
        for worker in settings.workers:
            worker.shutdown()


def test_an_engine_leaves_its_own_export_out_of_the_peers_every_engine_is_given():
    """One list naming every engine's export, given to each engine alike: engine k reads
    from the others only (itself would only add a round trip), however its own address is
    written, and keeps every other port and host."""
    from kvstrata.connectors.vllm.settings import KvGeometry, settings_from

    geometry = KvGeometry(BS, 2, 2, 8, "bfloat16", 64)
    env = {k: v for k, v in os.environ.items() if k.startswith("KVSTRATA_SHARING_")}
    exports = [f"tcp://127.0.0.1:{47100 + k}" for k in range(3)]
    extra = {"export": exports[0],
             "peers": [*exports, "tcp://localhost:47101", "tcp://192.0.2.7:47100"]}
    peers = [settings_from(extra, geometry, env, engine_index=k).peers for k in range(3)]
    assert peers == [
        (exports[1], exports[2], "tcp://localhost:47101", "tcp://192.0.2.7:47100"),
        (exports[0], exports[2], "tcp://192.0.2.7:47100"),
        (exports[0], exports[1], "tcp://localhost:47101", "tcp://192.0.2.7:47100")]
    wildcard = {"export": "tcp://0.0.0.0:47100",
                "peers": ["tcp://127.0.0.1:47100", "tcp://192.0.2.7:47100",
                          "tcp://[::1]:47100", "tcp://127.0.0.1:47101"]}
    assert settings_from(wildcard, geometry, env).peers == (
        "tcp://192.0.2.7:47100", "tcp://[::1]:47100", "tcp://127.0.0.1:47101")


def test_an_address_is_its_own_only_where_it_surely_names_the_same_server():
    from kvstrata.remote.control import is_own_address

    assert is_own_address("tcp://LOCALHOST:7000", "tcp://localhost:7000")
    assert is_own_address("tcp://localhost:7000", "tcp://127.0.0.1:7000")
    assert is_own_address("tcp://[::0001]:7000", "tcp://[::1]:7000")
    assert is_own_address("tcp://127.0.0.1:7000", "tcp://0.0.0.0:7000")   # every address
    assert is_own_address("tcp://[::1]:7000", "tcp://[::]:7000")
    assert is_own_address("tcp://127.0.0.1:7000", "tcp://[::]:7000")      # dual stack
    assert not is_own_address("tcp://127.0.0.1:7001", "tcp://127.0.0.1:7000")
    # an IPv4 socket on localhost is not the server of [::1], nor 0.0.0.0 of it
    assert not is_own_address("tcp://[::1]:7000", "tcp://localhost:7000")
    assert not is_own_address("tcp://[::1]:7000", "tcp://0.0.0.0:7000")
    # an address this host could bind, or a name: another machine's, maybe; kept
    assert not is_own_address("tcp://192.0.2.7:7000", "tcp://0.0.0.0:7000")
    assert not is_own_address("tcp://myhost:7000", "tcp://0.0.0.0:7000")
    assert not is_own_address("tcp://127.0.0.2:7000", "tcp://127.0.0.1:7000")


def test_engines_whose_g2s_fit_the_machine_alone_but_not_together_are_refused(tmp_path,
                                                                             monkeypatch):
    """Each data-parallel engine keeps its own G2 and checks it alone at start; their host
    RAM is also claimed across processes (kvstrata.kinds.ram_claims), so the engine that
    would take the machine over its RAM is refused at start, not killed by the OOM killer
    while serving."""
    from kvstrata.kinds import TierSetupError, ram_claims

    monkeypatch.setattr(ram_claims, "claims_directory", lambda: str(tmp_path / "claims"))
    first = SimEngine(tmp_path / "0", g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS)
    try:
        held = sum(n for _, n in ram_claims.held_claims(str(tmp_path / "claims")))
        assert held > 0
        monkeypatch.setattr(ram_claims, "physical_memory", lambda: held + held // 2)
        with pytest.raises(TierSetupError, match="already hold"):
            SimEngine(tmp_path / "1", g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS,
                      engine_index=1)
    finally:
        for worker in first.workers:
            worker.shutdown()
    assert ram_claims.held_claims(str(tmp_path / "claims")) == []
    again = SimEngine(tmp_path / "1", g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS,
                      engine_index=1)
    for worker in again.workers:
        worker.shutdown()


def test_a_worker_that_cannot_start_its_export_keeps_nothing_it_built(tmp_path, monkeypatch):
    """Its tiers were built (G2's RAM claimed) when the export's port turned out taken: the
    start fails, and the tiers, their RAM and the engine are let go at once, not at exit."""
    import socket

    from kvstrata.kinds import ram_claims

    monkeypatch.setattr(ram_claims, "claims_directory", lambda: str(tmp_path / "claims"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(OSError):
        SimEngine(tmp_path / "e", g2_blocks=16, g3_blocks=64, ranks=1, block_size=BS,
                  extra={"export": f"tcp://127.0.0.1:{port}"})
    taken.close()
    assert ram_claims.held_claims(str(tmp_path / "claims")) == []
