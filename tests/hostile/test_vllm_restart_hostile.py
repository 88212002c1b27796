"""The vLLM connector over a durable G3, restarted onto damaged files: the scheduler learns
the workers' blocks from their index files, but a block whose bytes one rank lost on disk
must be a failed load (recomputed by vLLM), never wrong KV in the engine."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from kvstrata.tokens import hash_blocks  # noqa: E402

from connectors.vllm.sim import LAYERS, SimEngine, assert_idle, block_kv  # noqa: E402
from connectors.vllm.test_halves import BS, prompt  # noqa: E402


def _first_run(tmp_path, tokens, ranks):
    sim = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=ranks, block_size=BS)
    sim.add("a", tokens)
    sim.run()
    where = []
    for worker in sim.workers:
        disk = worker.storages.by_tier["G3"]
        slots = {e.sequence_hash: e.slot for e in disk.index.entries()}
        where.append((disk.path, disk.layout.block_stride, slots))
        worker.shutdown()
    return where


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_block_a_rank_lost_on_disk_is_recomputed_never_loaded_wrong(tmp_path, damage):
    tokens = prompt(77, 8 * BS + 1)
    hashes = hash_blocks(tokens, BS)[1]
    (path0, stride, slots0), (path1, _, slots1) = _first_run(tmp_path, tokens, ranks=2)
    victim = hashes[2]
    if damage == "flip":                       # rank 1's copy of the third block rots
        with open(path1, "r+b") as fh:
            fh.seek(slots1[victim] * stride + 17)
            byte = fh.read(1)
            fh.seek(slots1[victim] * stride + 17)
            fh.write(bytes([byte[0] ^ 0x40]))
    else:                                      # rank 0's slab loses its tail
        with open(path0, "r+b") as fh:
            fh.truncate(min(slots0[h] for h in hashes[5:]) * stride)
    sim = SimEngine(tmp_path, g2_blocks=16, g3_blocks=64, ranks=2, block_size=BS)
    # both index files still name all eight blocks: the scheduler offers them
    assert sorted(sim.scheduler.planner.registry.hashes_in("G3")) == sorted(hashes[:8])
    request = sim.add("b", tokens + [5], max_new=2)
    for _ in range(20000):
        if request.state == "running":
            break
        sim.step()
    assert request.state == "running"
    assert sim.invalid_seen, "a damaged block was not reported invalid"
    seq = sim.scheduler._requests["b"].seq
    checked = 0
    for rank, layers in enumerate(sim.kv):
        for b in range(request.loaded):
            block_id = request.block_ids[b]
            if block_id in sim.invalid_seen:
                continue
            for layer in range(LAYERS):
                assert torch.equal(layers[layer][block_id], block_kv(seq[b], layer, rank, BS)), \
                    f"rank {rank} block {b} layer {layer}: wrong KV loaded"
            checked += 1
    assert checked >= 2 * 2                   # the prefix before the damage, on both ranks
    sim.run()
    assert_idle(sim)
    for worker in sim.workers:
        worker.shutdown()
