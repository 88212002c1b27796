"""An MLA model over several tensor-parallel ranks under SGLang: its KV is the same on every
rank, SGLang backs it up from rank 0 only and has every rank load it. kvstrata stores it once,
in rank 0's durable G3, and the other ranks read that G3 in place (their own process, their
own host pool), byte for byte; what rank 0 drops, overwrites or finds corrupt is never loaded
by the others; a rank that starts before rank 0 stored anything, or outlives a restart of
rank 0, follows along. SGLang's own factory and storage config throughout."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from contextlib import closing

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvstrata.connectors.sglang.settings import SGLangConfigError  # noqa: E402

from .test_backend import (PAGE, backend, flip_g3_byte, host_pool, keys_of,  # noqa: E402
                           page_bytes, slots, storage_config)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
LAYOUTS = ["page_first", "layer_first"]


def rank(tmp_path, r: int, layout: str = "page_first", seed: int | None = None, **extra):
    """The backend of tensor-parallel rank ``r`` of 2 for an MLA model, with its host pool."""
    pool = host_pool(layout, True, seed=r if seed is None else seed)
    return backend(tmp_path, pool, mla=True, tp_rank=r, tp_size=2, **extra), pool


def digest(pool, pages) -> list[str]:
    return [hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes()
                                    for t in page_bytes(pool, p, True))).hexdigest()
            for p in pages]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rank_1_in_its_own_process_loads_what_rank_0_stored_once(tmp_path, layout):
    keys = keys_of(5)
    writer, pool = rank(tmp_path, 0, layout)
    with closing(writer):
        assert writer.batch_set_v1(keys, slots([0, 1, 2, 3, 4])) == [True] * 5
        want = digest(pool, [0, 1, 2, 3, 4])
        script = textwrap.dedent(f"""
            import json, sys
            sys.path.insert(0, {ROOT!r})
            import pathlib
            from tests.connectors.sglang.test_mla_ranks import rank, digest
            from tests.connectors.sglang.test_backend import slots
            store, pool = rank(pathlib.Path({str(tmp_path)!r}), 1, {layout!r}, seed=7)
            keys = json.loads(sys.stdin.read())
            held = store.batch_exists(keys)
            got = store.batch_get_v1(keys, slots([9, 3, 12, 5, 14]))
            print(json.dumps([held, got, digest(pool, [9, 3, 12, 5, 14])]))
            store.close()
        """)
        done = subprocess.run([sys.executable, "-c", script], input=json.dumps(keys),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        held, got, loaded = json.loads(done.stdout.strip().splitlines()[-1])
        assert held == 5 and got == [True] * 5
        assert loaded == want
        homes = sorted(os.listdir(tmp_path / "g3"))
        assert len(homes) == 1 and "-r0-" in homes[0]           # one copy, rank 0's


def test_rank_1_stores_nothing_and_says_what_rank_0_holds(tmp_path):
    keys = keys_of(3)
    writer, _ = rank(tmp_path, 0)
    follower, _ = rank(tmp_path, 1)
    with closing(writer), closing(follower):
        writer.batch_set_v1(keys[:2], slots([0, 1]))
        assert follower.batch_set_v1(keys, slots([0, 1, 2])) == [True, True, False]
        assert writer.batch_exists(keys) == 2 and follower.batch_exists(keys) == 2
        assert len(os.listdir(tmp_path / "g3")) == 1


def test_a_rank_that_starts_first_follows_once_rank_0_stores(tmp_path):
    keys = keys_of(4)
    follower, fpool = rank(tmp_path, 1)
    with closing(follower):
        assert follower.batch_exists(keys) == 0
        assert follower.batch_get_v1(keys, slots([0, 1, 2, 3])) == [False] * 4
        writer, wpool = rank(tmp_path, 0)
        with closing(writer):
            writer.batch_set_v1(keys, slots([4, 5, 6, 7]))
            assert follower.batch_exists(keys) == 4
            assert follower.batch_get_v1(keys, slots([0, 1, 2, 3])) == [True] * 4
            assert digest(fpool, [0, 1, 2, 3]) == digest(wpool, [4, 5, 6, 7])


def test_pages_rank_0_clears_or_overwrites_are_never_loaded_by_rank_1(tmp_path):
    writer, wpool = rank(tmp_path, 0, **{"tiers": {"G3": {"blocks": 4}}})
    follower, fpool = rank(tmp_path, 1, **{"tiers": {"G3": {"blocks": 4}}})
    with closing(writer), closing(follower):
        first, second = keys_of(4), keys_of(4, b"second")
        writer.batch_set_v1(first, slots([0, 1, 2, 3]))
        assert follower.batch_exists(first) == 4
        writer.batch_set_v1(second, slots([4, 5, 6, 7]))     # G3 of 4 pages: all replaced
        writer.manager.wait_idle(10)
        assert follower.batch_exists(first) == 0
        before = digest(fpool, [8])
        assert follower.batch_get_v1(first[:1], slots([8])) == [False]
        assert digest(fpool, [8]) == before
        assert follower.batch_get_v1(second, slots([8, 9, 10, 11])) == [True] * 4
        assert digest(fpool, [8, 9, 10, 11]) == digest(wpool, [4, 5, 6, 7])
        writer.clear()
        assert follower.batch_exists(second) == 0
        assert follower.batch_get_v1(second, slots([12, 13, 14, 15])) == [False] * 4


def test_a_corrupt_page_in_rank_0s_g3_is_missing_for_rank_1_too(tmp_path):
    keys = keys_of(4)
    writer, _ = rank(tmp_path, 0)
    follower, fpool = rank(tmp_path, 1)
    with closing(writer), closing(follower):
        writer.batch_set_v1(keys, slots([0, 1, 2, 3]))
        flip_g3_byte(writer, keys[1], 9)
        before = digest(fpool, [5])
        assert follower.batch_get_v1(keys, slots([4, 5, 6, 7])) == [True, False, False, False]
        assert digest(fpool, [5]) == before


def test_rank_1_follows_rank_0_across_its_restart(tmp_path):
    keys = keys_of(3)
    follower, fpool = rank(tmp_path, 1)
    with closing(follower):
        writer, _ = rank(tmp_path, 0)
        writer.batch_set_v1(keys, slots([0, 1, 2]))
        assert follower.batch_exists(keys) == 3
        writer.close()
        assert follower.batch_exists(keys) == 3          # a stopped writer's G3 stays
        again, wpool = rank(tmp_path, 0, seed=5)
        with closing(again):
            more = keys_of(2, b"more")
            again.batch_set_v1(more, slots([3, 4]))
            assert follower.batch_exists(keys) == 3 and follower.batch_exists(more) == 2
            assert follower.batch_get_v1(more, slots([6, 7])) == [True, True]
            assert digest(fpool, [6, 7]) == digest(wpool, [3, 4])


def test_mla_over_several_ranks_needs_a_g3_in_a_directory(tmp_path):
    for r in (0, 1):
        config = storage_config(tmp_path, mla=True, tp_rank=r, tp_size=2)
        del config.extra_config["disk_dir"]
        made = StorageBackendFactory.create_backend("dynamic", config, None)
        with pytest.raises(SGLangConfigError, match="directory"):
            made.register_mem_pool_host(host_pool("page_first", True))
        assert made.manager is None and made.reader is None


def test_mla_with_decode_context_parallelism_is_refused(tmp_path):
    config = dataclasses.replace(storage_config(tmp_path, mla=True, tp_rank=0, tp_size=2),
                                 dcp_size=2, dcp_rank=0, logical_page_size=2 * PAGE)
    with pytest.raises(SGLangConfigError, match="decode context"):
        StorageBackendFactory.create_backend("dynamic", config, None)


def test_one_rank_mla_and_rank_0_of_two_share_their_pages(tmp_path):
    """MLA pages do not depend on the number of ranks: rank 0 of 2 stores under the same
    identity as a one-rank server, so either serves what the other stored."""
    keys = keys_of(2)
    single = backend(tmp_path, host_pool("page_first", True), mla=True)
    single.batch_set_v1(keys, slots([0, 1]))
    single.close()
    writer, _ = rank(tmp_path, 0)
    with closing(writer):
        assert writer.batch_exists(keys) == 2


def test_a_page_that_fails_on_rank_1_is_no_longer_counted_there(tmp_path):
    """Rank 0 serves the page from a G2 of its own and never reads its bad G3 copy; rank 1,
    which found it corrupt, stops counting it (SGLang then loads the shortest hit)."""
    tiers = {"tiers": {"G2": {"blocks": 64}, "G3": {"blocks": 64}}}
    keys = keys_of(4)
    writer, _ = rank(tmp_path, 0, **tiers)
    follower, fpool = rank(tmp_path, 1, **tiers)
    with closing(writer), closing(follower):
        writer.batch_set_v1(keys, slots([0, 1, 2, 3]))
        flip_g3_byte(writer, keys[1], 9)
        assert follower.batch_exists(keys) == 4
        assert follower.batch_get_v1(keys, slots([4, 5, 6, 7])) == [True, False, False, False]
        assert follower.batch_exists(keys) == 1
        assert follower.batch_get_v1(keys, slots([4, 5, 6, 7])) == [True, False, False, False]
