"""An MLA model over several tensor-parallel ranks (vLLM's latent ``[blocks, 1, block_size,
latent]`` is the same on every rank): its tiers keep one copy. Rank 0 writes G2 (in shared
memory) and G3; rank 1 reads rank 0's G2 and G3 in place (read-only) and writes none. Loads
come back byte for byte into both ranks from G2 and from G3, after a restart too; a corrupt
block in the one copy is recomputed on both ranks; the disk check counts one copy; each rank
keeps its own G2 where asked, or where shared memory is too small. (vLLM's CPU build does
not load MLA prefixes, so this runs in the simulator.)"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("vllm")

from kvstrata.connectors.vllm import worker as worker_module  # noqa: E402
from kvstrata.connectors.vllm.settings import (ConnectorConfigError, KvGeometry,  # noqa: E402
                                               settings_from, stored_as)
from kvstrata.kinds.base import TierSetupError  # noqa: E402
from kvstrata.physical.capacity import free_disk_bytes  # noqa: E402
from kvstrata.physical.storage.host_shared import (FollowedHostStorage,  # noqa: E402
                                                   PublishedHostStorage)

from .sim import LAYERS, SimEngine, assert_idle  # noqa: E402
from .test_groups import BS, hashes_of  # noqa: E402

def prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 900, (n,), generator=gen).tolist()


@pytest.fixture
def sims():
    made: list[SimEngine] = []
    yield made
    for sim in made:
        for worker in sim.workers:
            worker.shutdown()


def mla_sim(sims, directory, ranks=2, **kw) -> SimEngine:
    kw.setdefault("g2_blocks", 8)
    sim = SimEngine(directory, block_size=BS, mla=True, ranks=ranks, **kw)
    sims.append(sim)
    return sim


def homes(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("kvstrata-g3-"))


def returning(sim: SimEngine, tokens: list[int], name: str):
    request = sim.add(name, tokens + [5])
    for _ in range(2000):
        if request.state not in ("loading", "waiting"):
            break
        sim.step()
        time.sleep(0.001)
    return request


def assert_both_ranks_hold(sim: SimEngine, request, tokens: list[int], blocks: int) -> None:
    seq = hashes_of(sim, tokens)
    for rank in range(len(sim.workers)):
        for layer in range(LAYERS):
            for b in range(blocks):
                assert torch.equal(sim.kv[rank][layer][request.block_ids[b]],
                                   sim.page_kv(seq[b], layer, rank)), (rank, layer, b)


def test_identities_of_replicated_ranks():
    assert [stored_as(r, 4, 2) for r in range(4)] == [
        stored_as(0, 2), stored_as(0, 2, 1).__class__(0, 2, False),
        stored_as(1, 2), stored_as(1, 2, 1).__class__(1, 2, False)]
    assert stored_as(3, 4) == stored_as(3, 4, 1)
    assert stored_as(3, 4).writer and (stored_as(3, 4).rank, stored_as(3, 4).world_size) == (3, 4)


def test_g3_keeps_one_copy_that_loads_into_both_ranks(sims, tmp_path):
    sim = mla_sim(sims, tmp_path / "mla")
    assert sim.settings.replicas == 2
    first = prompt(10, 6 * BS + 1)
    sim.add("a", first)
    sim.run()
    for i in range(2):                            # push "a" out of G2 into G3
        sim.add(f"f{i}", prompt(20 + i, 6 * BS + 1))
        sim.run()
    request = returning(sim, first, "b")
    assert request.loaded == 6
    assert sim.scheduler.counters.blocks_loaded.get("G3", 0) > 0
    assert_both_ranks_hold(sim, request, first, 6)
    sim.run()
    assert_idle(sim)
    assert homes(tmp_path / "mla") == [homes(tmp_path / "mla")[0]]
    assert "-r0-" in homes(tmp_path / "mla")[0]
    writer, reader = (w.storages.by_tier["G3"] for w in sim.workers)
    assert not writer.followed and reader.followed
    assert reader.path == writer.path             # the same file, read in place


def test_both_ranks_load_from_one_g2_copy_in_shared_memory(sims, tmp_path):
    sim = mla_sim(sims, tmp_path / "mla")
    assert sim.settings.shared_host_dir == "/dev/shm"
    first = prompt(11, 5 * BS + 1)
    sim.add("a", first)
    sim.run()
    request = returning(sim, first, "b")
    assert request.loaded == 5
    assert sim.scheduler.counters.blocks_loaded.get("G2", 0) == 5
    assert_both_ranks_hold(sim, request, first, 5)
    writer, reader = (w.storages.by_tier["G2"] for w in sim.workers)
    assert isinstance(writer, PublishedHostStorage) and isinstance(reader, FollowedHostStorage)
    assert reader.file.path == writer.file.path and writer.file.path.exists()
    assert reader.checksums.valid_mask().sum() == 0       # rank 1 sealed nothing itself
    sim.run()
    assert_idle(sim)
    for worker in sim.workers:
        worker.shutdown()
    sims.remove(sim)
    assert not writer.file.path.exists()                  # removed with the writer


def test_a_corrupt_block_in_the_shared_g2_is_recomputed_on_both_ranks(sims, tmp_path):
    sim = mla_sim(sims, tmp_path / "mla", g3_blocks=None)
    first = prompt(16, 5 * BS + 1)
    sim.add("a", first)
    sim.run()
    g2 = sim.workers[0].storages.by_tier["G2"]
    slot = sim.scheduler.planner.pools["G2"].lookup(hashes_of(sim, first)[1]).block_id
    g2.payload(slot)[7] ^= 0x40                     # one bit flipped in the one copy
    request = returning(sim, first, "b")
    assert sim.invalid_seen                          # reported, recomputed from there
    assert request.num_computed_tokens <= BS
    sim.step()
    assert_both_ranks_hold(sim, request, first, 5)
    sim.run()


def test_each_rank_keeps_its_own_g2_where_asked_or_where_it_cannot_share(sims, tmp_path):
    own = mla_sim(sims, tmp_path / "own", extra={"share_host_tier": False})
    assert own.settings.replicas == 2 and own.settings.shared_host_dir is None
    first = prompt(17, 4 * BS + 1)
    own.add("a", first)
    own.run()
    request = returning(own, first, "b")
    assert request.loaded == 4
    assert_both_ranks_hold(own, request, first, 4)
    g2 = [w.storages.by_tier["G2"] for w in own.workers]
    assert not any(isinstance(s, (PublishedHostStorage, FollowedHostStorage)) for s in g2)
    own.run()
    nowhere = str(tmp_path / "no-such-dir")
    auto = mla_sim(sims, tmp_path / "auto", extra={"shared_memory_dir": nowhere})
    assert auto.settings.shared_host_dir is None
    with pytest.raises(ConnectorConfigError, match="share_host_tier.*not a directory"):
        mla_sim(sims, tmp_path / "must", extra={"share_host_tier": True,
                                                "shared_memory_dir": nowhere})
    with pytest.raises(ConnectorConfigError, match="shared_memory_dir"):
        mla_sim(sims, tmp_path / "bad", extra={"shared_memory_dir": "relative/dir"})
    with pytest.raises(ConnectorConfigError, match="share_host_tier.*G3 is in a directory"):
        mla_sim(sims, tmp_path / "temp", durable=False, extra={"share_host_tier": True})


def test_a_restart_recovers_the_one_copy_into_both_ranks(sims, tmp_path):
    first = prompt(12, 6 * BS + 1)
    sim = mla_sim(sims, tmp_path / "mla")
    sim.add("a", first)
    sim.run()
    for worker in sim.workers:
        worker.shutdown()
    sims.remove(sim)
    again = mla_sim(sims, tmp_path / "mla")
    request = returning(again, first, "b")
    assert request.loaded == 6
    assert again.scheduler.counters.blocks_loaded.get("G3", 0) == 6
    assert_both_ranks_hold(again, request, first, 6)
    again.run()


def test_a_corrupt_block_in_the_one_copy_is_recomputed_on_both_ranks(sims, tmp_path):
    sim = mla_sim(sims, tmp_path / "mla")
    first = prompt(13, 6 * BS + 1)
    sim.add("a", first)
    sim.run()
    for i in range(2):
        sim.add(f"f{i}", prompt(30 + i, 6 * BS + 1))
        sim.run()
    disk = sim.workers[0].storages.by_tier["G3"]
    seq = hashes_of(sim, first)
    slot = sim.scheduler.planner.pools["G3"].lookup(seq[2]).block_id
    with open(disk.path, "r+b") as fh:              # one byte flipped on disk
        fh.seek(slot * disk.layout.block_stride + 3)
        byte = fh.read(1)
        fh.seek(slot * disk.layout.block_stride + 3)
        fh.write(bytes([byte[0] ^ 0x10]))
    request = returning(sim, first, "b")
    assert sim.invalid_seen                        # the bad block was reported, recomputed
    assert request.num_computed_tokens <= 2 * BS   # vLLM recomputes from it
    sim.step()                                     # the forward that recomputes them
    assert_both_ranks_hold(sim, request, first, 6)
    sim.run()


def test_ranks_of_a_model_that_is_not_mla_keep_their_own_g3(sims, tmp_path):
    sim = SimEngine(tmp_path / "mha", block_size=BS, g2_blocks=8, ranks=2)
    sims.append(sim)
    sim.add("a", prompt(14, 3 * BS + 1))
    sim.run()
    names = homes(tmp_path / "mha")
    assert len(names) == 2 and "-r0-" in names[0] and "-r1-" in names[1]
    assert not any(w.storages.by_tier["G3"].followed for w in sim.workers)


def test_the_disk_check_counts_one_copy_of_replicated_blocks(tmp_path):
    free = free_disk_bytes(str(tmp_path))
    if not free:
        pytest.skip("this filesystem does not say how much it has free")
    extra = {"tiers": {"G2": {"blocks": 8}, "G3": {"bytes": int(free * 0.6)}},
             "disk_dir": str(tmp_path), "o_direct": False}
    geometry = dict(block_size=BS, num_layers=LAYERS, kv_heads=1, head_dim=512,  # 8 KiB
                    dtype="bfloat16", num_gpu_blocks=64, outer_dim=1, workers=8)
    settings = settings_from(extra, KvGeometry(**geometry, replicas=8), env={})
    assert settings.replicas == 8
    with pytest.raises(ConnectorConfigError, match="disk"):
        settings_from(extra, KvGeometry(**geometry, replicas=1), env={})


def test_a_rank_whose_writer_never_comes_gives_up_with_the_reason(sims, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setattr(worker_module, "WRITER_WAIT", 0.3)
    sim = mla_sim(sims, tmp_path / "mla")
    lone = worker_module.WorkerHalf(sim.settings, rank=1, world_size=2,
                                    server=sim.workers[0].server)
    settings = sim.settings
    other = tmp_path / "elsewhere"
    from dataclasses import replace
    lone.settings = replace(settings, kv=replace(settings.kv, disk_dir=str(other)))
    with pytest.raises(TierSetupError, match=f"G3 .*did not appear.*{other}"):
        lone.register_kv_caches({f"model.layers.{i}.attn": torch.zeros(64, 1, BS, 32,
                                                                       dtype=torch.bfloat16)
                                 for i in range(LAYERS)})
    assert not other.exists()


def test_a_temporary_g3_keeps_a_copy_per_rank_as_before(sims, tmp_path):
    sim = SimEngine(tmp_path / "tmp", block_size=BS, g2_blocks=8, mla=True, ranks=2,
                    durable=False)
    sims.append(sim)
    assert sim.settings.replicas == 1
    first = prompt(15, 4 * BS + 1)
    sim.add("a", first)
    sim.run()
    assert not any(w.storages.by_tier["G3"].followed for w in sim.workers)
    request = returning(sim, first, "b")
    assert request.loaded == 4
    assert_both_ranks_hold(sim, request, first, 4)
    sim.run()


def test_a_rank_that_registers_before_the_writer_waits_for_it(sims, tmp_path, monkeypatch):
    """vLLM starts its workers together: rank 1 may wrap its KV cache before rank 0 made
    the G3 it follows. It waits (its own G1 and G2 intact), then follows it."""
    import threading
    from dataclasses import replace

    monkeypatch.setattr(worker_module, "WRITER_WAIT", 60.0)
    proto = mla_sim(sims, tmp_path / "proto")
    settings = replace(proto.settings,
                       kv=replace(proto.settings.kv, disk_dir=str(tmp_path / "late")))
    server = f"{proto.workers[0].server}-late"
    workers = [worker_module.WorkerHalf(settings, rank=r, world_size=2, server=server)
               for r in (0, 1)]
    caches = [{f"model.layers.{i}.attn": torch.zeros(64, 1, BS, 32, dtype=torch.bfloat16)
               for i in range(LAYERS)} for _ in workers]
    errors = []

    def register_follower():
        try:
            workers[1].register_kv_caches(caches[1])
        except BaseException as exc:      # reported below
            errors.append(exc)

    follower = threading.Thread(target=register_follower, daemon=True)
    follower.start()
    try:
        follower.join(0.5)
        assert follower.is_alive() and workers[1].storages is None    # waiting for rank 0
        workers[0].register_kv_caches(caches[0])
        follower.join(60)
        assert not errors, errors
        g3 = workers[1].storages.by_tier["G3"]
        assert g3.followed and g3.path == workers[0].storages.by_tier["G3"].path
        assert isinstance(workers[1].storages.by_tier["G2"], FollowedHostStorage)
        assert not workers[1].storages.by_tier["G1"].closed
        assert workers[1].engine is not None
    finally:
        follower.join(60)
        for worker in workers:
            worker.shutdown()


def test_which_ranks_share_one_copy_in_vllms_parallel_configs():
    """From vLLM's own ``ParallelConfig``: a tensor-parallel group shares a copy only where
    it runs whole on one machine, and not where decode context parallelism splits it."""
    from vllm.config import ParallelConfig

    from kvstrata.connectors.vllm.connector import _replicating_ranks

    def ranks(**kw):
        return _replicating_ranks(ParallelConfig(**kw))

    assert ranks(tensor_parallel_size=1) == 1
    assert ranks(tensor_parallel_size=4) == 4
    assert ranks(tensor_parallel_size=4, pipeline_parallel_size=2) == 4
    assert ranks(tensor_parallel_size=4, decode_context_parallel_size=2) == 1
    assert ranks(tensor_parallel_size=8, pipeline_parallel_size=2, nnodes=2) == 8
    assert ranks(tensor_parallel_size=16, nnodes=2) == 1       # a group over two machines
    assert ranks(tensor_parallel_size=4, distributed_executor_backend="external_launcher") == 1


def test_ranks_whose_blocks_another_wrote_time_nothing_in_the_combined_result():
    """A follower reports a plan into G3 done at once (``done_elsewhere``): the combined
    result takes its time, wait and checksums from the rank that moved the bytes, so an
    engine's idle gap before the writer's report is not learned as G3 latency."""
    from dataclasses import replace

    from kvstrata.connectors.vllm.metadata import combine
    from kvstrata.protocol.plans import Endpoint, TransferPlan
    from kvstrata.protocol.results import FailureKind, TransferResult

    plan = TransferPlan(1, Endpoint("G2"), Endpoint("G3"), (11, 12), src_block_ids=(0, 1),
                        dst_block_ids=(2, 3))
    moved = TransferResult(plan, (True, True), (7, 8), 1024, 0.01, held_seconds=0.002,
                           waited_seconds=0.25)
    elsewhere = TransferResult.done_elsewhere(plan)
    assert not elsewhere.moved_here and elsewhere.bytes_moved == 0
    for results in ([elsewhere, moved], [moved, elsewhere]):
        got = combine(results)
        assert (got.seconds, got.held_seconds, got.waited_seconds) == (0.01, 0.002, 0.25)
        assert got.checksums == (7, 8) and got.bytes_moved == 1024 and got.moved_here
    failed = replace(moved, ok=(True, False), checksums=(7, None), failures=(
        TransferResult.failed(plan, FailureKind.DISK_FULL, "full").failures[1],))
    assert combine([elsewhere, failed]).ok == (True, False)
    again = TransferResult.from_dict(elsewhere.to_dict())
    assert again == elsewhere
    old = elsewhere.to_dict()
    del old["moved_here"]                         # a report from before the field
    assert TransferResult.from_dict(old).moved_here
    with pytest.raises(Exception, match="moved_here"):
        TransferResult.from_dict({**elsewhere.to_dict(), "moved_here": 1})
