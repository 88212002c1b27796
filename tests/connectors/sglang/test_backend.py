"""kvstrata as SGLang HiCache's storage backend, against SGLang's own classes (the pinned
sglang package): loaded by SGLang's ``StorageBackendFactory`` as a dynamic backend, pages of a
host pool stored and loaded back byte for byte in every host layout SGLang has, a corrupt G3
page reported missing (never wrong bytes), and a durable G3 that a restarted backend serves.

SGLang's host pool classes themselves cannot be built here (they import torchvision, which
vLLM's CPU build excludes from this environment): the pool given to the backend is an object
with the attributes the backend reads (``layout``, ``page_size``, ``size``, ``kv_buffer``)
and SGLang's buffer shapes for each layout (sglang/srt/mem_cache/pool_host/{mha,mla}.py)."""

from __future__ import annotations

import json

import hashlib
from contextlib import closing
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageConfig,  # noqa: E402
                                                  HiCacheStorageExtraInfo)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvstrata.connectors.sglang import KvStrataStorage, page_hash  # noqa: E402
from kvstrata.connectors.sglang.settings import SGLangConfigError  # noqa: E402

PAGE, PAGES, LAYERS, HEADS, DIM, LATENT = 4, 16, 3, 2, 8, 24
TOKENS = PAGE * PAGES

SHAPES = {   # SGLang's host kv_buffer shapes (pool_host/mha.py, pool_host/mla.py)
    ("page_first", False): (2, TOKENS, LAYERS, HEADS, DIM),
    ("layer_first", False): (2, LAYERS, TOKENS, HEADS, DIM),
    ("page_first_direct", False): (2, PAGES, LAYERS, PAGE, HEADS, DIM),
    ("page_head", False): (2, PAGES, HEADS, PAGE, LAYERS, DIM),
    ("page_first", True): (TOKENS, LAYERS, 1, LATENT),
    ("layer_first", True): (LAYERS, TOKENS, 1, LATENT),
}


def host_pool(layout: str, mla: bool, seed: int = 0):
    buffer = torch.randn(SHAPES[layout, mla], generator=torch.Generator().manual_seed(seed))
    return SimpleNamespace(layout=layout, page_size=PAGE, size=TOKENS,
                           kv_buffer=buffer.to(torch.bfloat16))


def storage_config(tmp_path, mla=False, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                   dp_rank=0, **extra):
    extra_config = {"backend_name": "kvstrata", "module_path": "kvstrata.connectors.sglang",
                    "class_name": "KvStrataStorage", "interface_v1": 1,
                    "tiers": {"G3": {"blocks": 64}}, "disk_dir": str(tmp_path / "g3"), **extra}
    extra_config = {k: v for k, v in extra_config.items() if v is not None}
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                                pp_size=pp_size, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name="tiny-test",
                                dp_rank=dp_rank, extra_config=extra_config)


def backend(tmp_path, pool, mla=False, **extra) -> KvStrataStorage:
    made = StorageBackendFactory.create_backend("dynamic", storage_config(tmp_path, mla,
                                                                          **extra), None)
    assert isinstance(made, KvStrataStorage)
    made.register_mem_pool_host(pool)
    return made


def keys_of(n: int, salt: bytes = b"") -> list[str]:
    """Chained page keys as SGLang makes them: hex SHA-256 of the previous digest and the
    page's tokens (little-endian uint32)."""
    keys, digest = [], hashlib.sha256(salt).digest() if salt else b""
    for i in range(n):
        tokens = b"".join((1000 * i + t).to_bytes(4, "little") for t in range(PAGE))
        digest = hashlib.sha256(digest + tokens).digest()
        keys.append(digest.hex())
    return keys


def flip_g3_byte(store: KvStrataStorage, key: str, at: int) -> None:
    """Flip byte ``at`` of the page ``key`` in ``store``'s G3 slab (another writer)."""
    store.manager.wait_idle(10)
    disk = store.manager.storage("G3")
    slot = store.manager.pools["G3"].lookup(page_hash(key)).block_id
    with open(disk.path, "r+b") as fh:
        fh.seek(slot * disk.layout.block_stride + at)
        byte = fh.read(1)
        fh.seek(slot * disk.layout.block_stride + at)
        fh.write(bytes([byte[0] ^ 0xFF]))


def slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def page_bytes(pool, page: int, mla: bool) -> list[torch.Tensor]:
    """Every value of host page ``page`` (in whatever layout), for comparisons."""
    from kvstrata.connectors.sglang.host_pool import wrap_host_pool

    return [run[page].clone() for run in wrap_host_pool(pool, mla).runs]


@pytest.mark.parametrize("layout, mla", list(SHAPES))
def test_pages_go_down_and_come_back_byte_for_byte(tmp_path, layout, mla):
    pool = host_pool(layout, mla)
    with closing(backend(tmp_path, pool, mla)) as store:
        keys = keys_of(6)
        written = [page_bytes(pool, p, mla) for p in range(6)]
        assert store.batch_exists(keys) == 0
        assert store.batch_set_v1(keys, slots(list(range(6)))) == [True] * 6
        assert store.batch_exists(keys) == 6
        assert store.batch_exists(keys[:3] + keys_of(1, b"other")) == 3
        pool.kv_buffer[...] = 0                        # SGLang reuses its host pages
        assert store.batch_get_v1(keys, slots([9, 10, 11, 12, 13, 14])) == [True] * 6
        for i, page in enumerate(range(9, 15)):
            for got, want in zip(page_bytes(pool, page, mla), written[i]):
                assert torch.equal(got, want), (layout, mla, i)
        assert page_bytes(pool, 0, mla)[0].abs().sum() == 0     # nothing else written


def test_a_prefix_past_what_is_held_loads_only_the_held_pages(tmp_path):
    pool = host_pool("page_first", False)
    with closing(backend(tmp_path, pool)) as store:
        keys = keys_of(5)
        store.batch_set_v1(keys[:3], slots([0, 1, 2]))
        before = page_bytes(pool, 7, False)
        assert store.batch_get_v1(keys, slots([4, 5, 6, 7, 8])) == [True] * 3 + [False] * 2
        assert all(torch.equal(a, b) for a, b in zip(page_bytes(pool, 7, False), before))


def test_a_corrupt_g3_page_is_reported_missing_never_loaded(tmp_path):
    pool = host_pool("page_first", False)
    with closing(backend(tmp_path, pool)) as store:
        keys = keys_of(4)
        store.batch_set_v1(keys, slots([0, 1, 2, 3]))
        flip_g3_byte(store, keys[2], 5)
        before = page_bytes(pool, 12, False)
        got = store.batch_get_v1(keys, slots([10, 11, 12, 13]))
        assert got == [True, True, False, False]
        assert all(torch.equal(a, b) for a, b in zip(page_bytes(pool, 12, False), before))
        assert store.batch_exists(keys) == 2           # the bad page was dropped


def test_a_restarted_backend_serves_its_durable_g3(tmp_path):
    pool = host_pool("layer_first", False, seed=3)
    keys = keys_of(4)
    written = [page_bytes(pool, p, False) for p in range(4)]
    first = backend(tmp_path, pool)
    first.batch_set_v1(keys, slots([0, 1, 2, 3]))
    first.close()
    fresh = host_pool("layer_first", False, seed=4)
    second = backend(tmp_path, fresh)
    try:
        assert second.batch_exists(keys) == 4
        assert second.batch_get_v1(keys, slots([5, 6, 7, 8])) == [True] * 4
        for i in range(4):
            assert all(torch.equal(a, b) for a, b in zip(page_bytes(fresh, 5 + i, False),
                                                         written[i]))
    finally:
        second.close()


def test_another_host_layout_never_reads_the_stored_pages(tmp_path):
    keys = keys_of(2)
    first = backend(tmp_path, host_pool("page_first", False))
    first.batch_set_v1(keys, slots([0, 1]))
    first.close()
    second = backend(tmp_path, host_pool("page_head", False))   # same sizes, other order
    try:
        assert second.batch_exists(keys) == 0
    finally:
        second.close()


def test_prefix_keys_chain_the_first_page_of_a_batch(tmp_path):
    pool = host_pool("page_first", False)
    with closing(backend(tmp_path, pool)) as store:
        keys = keys_of(4)
        info = HiCacheStorageExtraInfo(prefix_keys=keys[:2])
        records = store._records(keys[2:], info)
        assert records[0].parent_hash == page_hash(keys[1])
        assert records[1].parent_hash == page_hash(keys[2])
        assert store._records(keys[:1], None)[0].parent_hash is None


@pytest.mark.parametrize("extra, match", [
    ({"interface_v1": 0}, "interface_v1"),
    ({"colour": "blue"}, "unknown keys"),
    ({"tiers": {"G1": {"blocks": 4}, "G3": {"blocks": 4}}}, "host pool"),
    ({"tiers": 7}, "tiers must be"),
])
def test_bad_settings_are_refused_with_every_problem(tmp_path, extra, match):
    with pytest.raises(SGLangConfigError, match=match):
        StorageBackendFactory.create_backend("dynamic", storage_config(tmp_path, **extra), None)


def test_ranks_keep_their_own_pages(tmp_path):
    pools = [host_pool("page_first", False, seed=r) for r in (0, 1)]
    stores = [backend(tmp_path, pools[r], tp_rank=r, tp_size=2) for r in (0, 1)]
    try:
        keys = keys_of(2)
        stores[0].batch_set_v1(keys, slots([0, 1]))
        assert stores[0].batch_exists(keys) == 2 and stores[1].batch_exists(keys) == 0
    finally:
        for s in stores:
            s.close()


def test_host_slots_that_are_not_whole_pages_store_nothing(tmp_path):
    pool = host_pool("page_first", False)
    with closing(backend(tmp_path, pool)) as store:
        keys = keys_of(2)
        assert store.batch_set_v1(keys, slots([0, 1])[1:]) == [False, False]
        shifted = slots([0, 1]) + 1
        assert store.batch_set_v1(keys, shifted) == [False, False]
        assert store.batch_exists(keys) == 0


def test_stored_pages_are_published_as_events(tmp_path):
    import json

    sink = tmp_path / "events.jsonl"
    pool = host_pool("page_first", False)
    store = backend(tmp_path, pool, events=f"jsonl:{sink}", worker_id=7)
    keys = keys_of(3)
    try:
        store.batch_set_v1(keys, slots([0, 1, 2]))
        store.manager.wait_idle(10)
    finally:
        store.close()                                  # flushes the sink
    lines = [json.loads(line) for line in sink.read_text().splitlines()]
    text = json.dumps(lines)
    assert all(str(page_hash(k)) in text for k in keys), text[:400]
    assert all(line.get("worker_id", 7) == 7 for line in lines)


def test_a_bad_event_sink_is_refused_at_start(tmp_path):
    with pytest.raises(SGLangConfigError, match="events"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(tmp_path, events=f"jsonl:{tmp_path}/no/such/dir/x"), None)


def test_pipeline_stages_and_data_parallel_ranks_keep_their_own_pages(tmp_path):
    """Two pipeline stages hold other layers under one model name, data-parallel attention
    ranks are all tp rank 0: each starts beside the others in one disk_dir, none reads
    another's pages."""
    keys = keys_of(2)
    made = [backend(tmp_path, host_pool("page_first", False, seed=i), **kw)
            for i, kw in enumerate([{"pp_rank": 0, "pp_size": 2}, {"pp_rank": 1, "pp_size": 2},
                                    {"dp_rank": 1}])]
    try:
        made[0].batch_set_v1(keys, slots([0, 1]))
        assert [m.batch_exists(keys) for m in made] == [2, 0, 0]
    finally:
        for m in made:
            m.close()


def test_a_data_parallel_ranks_events_go_to_a_file_of_its_own(tmp_path):
    """Data-parallel attention ranks each publish their own events (SGLang gives each a
    backend): rank 1 writes <stem>.dp1<suffix>, stamped with its rank; a NATS sink in
    kvstrata's format (no rank in it) is refused beyond rank 0."""
    events = tmp_path / "events.jsonl"
    with closing(backend(tmp_path, host_pool("page_first", False), dp_rank=1,
                         events=f"dynamo-json:{events}")) as store:
        store.batch_set_v1(keys_of(2), slots([0, 1]))
    lines = (tmp_path / "events.dp1.jsonl").read_text().splitlines()
    assert lines and all(json.loads(line)["event"]["dp_rank"] == 1 for line in lines)
    assert not events.exists()
    with pytest.raises(SGLangConfigError, match="format=dynamo"):
        backend(tmp_path, host_pool("page_first", False), dp_rank=1,
                events="nats://127.0.0.1:4222/kv.events")


def test_a_pool_with_part_of_its_pages_elsewhere_is_refused(tmp_path):
    pool = host_pool("page_first", False)
    pool.k_scale_host = torch.zeros(4)             # an MXFP8 pool keeps scales aside
    with pytest.raises(SGLangConfigError, match="outside"):
        backend(tmp_path, pool)


def test_a_hybrid_models_side_pools_are_refused_at_start(tmp_path):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    with closing(backend(tmp_path, host_pool("page_first", False))) as store:
        store.register_mem_host_pool_v2(store.mem_pool_host, PoolName.KV)   # the KV anchor
        with pytest.raises(SGLangConfigError, match="mamba"):
            store.register_mem_host_pool_v2(object(), PoolName.MAMBA)
        # SGLang does not undo an attach that failed there: the refused backend let go of
        # its G3 (held locked, an attach again on the same directory was refused)
        assert store.manager is None
        with closing(backend(tmp_path, host_pool("page_first", False))) as again:
            assert again.manager is not None


def test_sglangs_own_keys_are_accepted_where_a_decode_server_hands_them_on(tmp_path):
    """A PD decode server's offload manager hands the whole extra config to the backend,
    SGLang's prefetch keys included (its cache controller takes them out elsewhere): they
    were refused as unknown, and the decode server did not start."""
    own = {"prefetch_threshold": 256, "prefetch_timeout_base": 1,
           "prefetch_timeout_per_ki_token": 0.25, "hicache_storage_pass_prefix_keys": True,
           "tp_lcm_size": 2}
    with closing(backend(tmp_path, host_pool("page_first", False), **own)) as store:
        store.batch_set_v1(keys_of(2), slots([0, 1]))
        assert store.batch_exists(keys_of(2)) == 2


def test_data_parallel_ranks_keep_their_own_g3_wherever_its_directory_is_named(tmp_path):
    """Only disk_dir got a directory per data-parallel rank: with the tier's own path, every
    rank (all tp rank 0) claimed one G3 home, and rank 1 could not start."""
    tiers = {"G3": {"blocks": 64, "path": str(tmp_path / "g3p")}}
    made = [backend(tmp_path, host_pool("page_first", False, seed=rank), dp_rank=rank,
                    tiers=tiers, disk_dir=None) for rank in (0, 1)]
    try:
        made[0].batch_set_v1(keys_of(2), slots([0, 1]))
        assert [m.batch_exists(keys_of(2)) for m in made] == [2, 0]
    finally:
        for m in made:
            m.close()


def test_cleared_pages_stay_gone_after_a_restart(tmp_path):
    keys = keys_of(3)
    first = backend(tmp_path, host_pool("page_first", False))
    first.batch_set_v1(keys, slots([0, 1, 2]))
    first.clear()
    assert first.batch_exists(keys) == 0
    first.close()
    second = backend(tmp_path, host_pool("page_first", False))
    try:
        assert second.batch_exists(keys) == 0
    finally:
        second.close()


def test_keys_that_share_a_prefix_are_other_pages():
    a = "ab" * 32
    assert page_hash(a) == int(a[:16], 16)
    assert page_hash(a + "_L0-3") != page_hash(a + "_L4-7") != page_hash(a)
    assert 0 <= page_hash("-" + a[1:]) < 2**64


def test_a_page_whose_slots_are_not_one_whole_page_stores_nothing(tmp_path):
    with closing(backend(tmp_path, host_pool("page_first", False))) as store:
        mixed = torch.tensor([8, 21, 22, 23, 4, 5, 6, 7])
        assert store.batch_set_v1(keys_of(2), mixed) == [False, False]
        assert store.batch_exists(keys_of(2)) == 0


def test_a_closed_backend_answers_misses(tmp_path):
    store = backend(tmp_path, host_pool("page_first", False))
    store.close()
    keys = keys_of(1)
    assert store.batch_exists(keys) == 0
    assert store.batch_set_v1(keys, slots([0])) == [False]
    assert store.batch_get_v1(keys, slots([0])) == [False]
