"""Prefill-to-decode sharing between two real processes: the prefill-shaped worker computes
blocks and publishes its events on NATS; the decode-shaped worker (this process) learns from
the events which worker holds a prompt's prefix, imports that worker's block set, fetches the
prefix over NIXL into its own G2 and onboards it into G1, byte-exact, instead of
recomputing it."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from kvstrata.remote.nixl_agent import nixl_available

if not nixl_available():
    pytest.skip("NIXL is not installed (scripts/setup.sh installs it)", allow_module_level=True)

from kvstrata.events.indexer import PrefixIndex  # noqa: E402
from kvstrata.events.subscriber import NatsFollower  # noqa: E402
from kvstrata.manager import KvBlockManager  # noqa: E402
from kvstrata.remote.errors import LeaseError, RemoteReadError  # noqa: E402
from kvstrata.testing.exporter import (chain_tokens, geometry_config, payload_of,  # noqa: E402
                                       start_exporter)
from kvstrata.tokens import hash_blocks  # noqa: E402
from kvstrata.types import BlockRecord  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PREFILL_WORKER = 7
BLOCKS = 8


def records_of(tokens: list[int], block_size: int) -> list[BlockRecord]:
    local, seqs = hash_blocks(tokens, block_size)
    return [BlockRecord(s, l, p, block_size) for s, l, p in zip(seqs, local, [None, *seqs[:-1]])]


def test_a_decode_worker_onboards_a_prefix_from_the_prefill_workers_memory(nats_server):
    subject = f"kvtest.{uuid.uuid4().hex[:10]}"
    index = PrefixIndex()
    with NatsFollower(nats_server.url, subject, index, jetstream=False) as follower:
        prefill = start_exporter(chains=2, chain_blocks=BLOCKS, g2_blocks=32,
                                 events=f"{nats_server.url}/{subject}",
                                 worker_id=PREFILL_WORKER)
        try:
            config = geometry_config({"G1": 16, "G2": 32})
            bs = config.block_size
            records = records_of(chain_tokens(1, BLOCKS, bs) + [5, 6, 7], bs)  # + a tail
            hashes = [r.sequence_hash for r in records]
            assert hashes == prefill.chains[1]
            # the decode worker finds the prefix through the prefill worker's events
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and \
                    index.match(hashes).get(PREFILL_WORKER, {}).get("G2", 0) < BLOCKS:
                time.sleep(0.05)
            assert index.match(hashes)[PREFILL_WORKER]["G2"] == BLOCKS
            assert follower.follower.applied > 0

            with KvBlockManager(config) as decode:
                assert decode.locate(hashes).result(10) == []          # holds nothing
                peer = decode.importer().connect(prefill.control)
                assert decode.fetch_remote(peer, records).result(30) == BLOCKS
                assert decode.locate(hashes).result(10) == ["G2"] * BLOCKS
                assert _released(prefill)                              # lease let go
                with decode.onboard(hashes).result(30) as loaded:
                    assert len(loaded) == BLOCKS and set(loaded.sources) == {"G2"}
                    got = decode.read_g1(loaded.block_ids)
                    for h, data in zip(hashes, got):
                        assert np.array_equal(data, payload_of(h, prefill.block_bytes))
                # fetching again moves nothing: the prefix is held
                assert decode.fetch_remote(peer, records).result(30) == 0
                # the prefill worker dies: a fetch of what only it held fails, nothing kept
                other = records_of(chain_tokens(0, BLOCKS, bs), bs)
                prefill.kill()
                with pytest.raises((LeaseError, RemoteReadError)):
                    decode.fetch_remote(peer, other).result(30)
                assert decode.locate([r.sequence_hash for r in other]).result(10) == []
                decode.wait_idle(10)
                assert decode.status()["tiers"]["G2"]["pool"]["active"] == 0
        finally:
            prefill.stop()


def _released(prefill) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if prefill.status()["leases"] == 0:
            return True
        time.sleep(0.05)
    return False
