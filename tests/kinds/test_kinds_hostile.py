"""Hostile review of kvstrata.kinds against what manager/storages.py and the vLLM connector's
own ``_check_runnable`` did before the refactor: every refusal and its words, what is left
behind on each error path, what ``peek_recovered`` promises (None vs empty), and which
directory a disk tier lives in. The two bugs it found are fixed; their tests say what was
wrong."""

from __future__ import annotations

import os
import pathlib
import tempfile

import numpy as np
import pytest
import torch

import kvstrata.kinds as kinds
import kvstrata.kinds.disk as disk_kind
from kvstrata.config import KvConfig, ModelGeometry, TierConfig
from kvstrata.kinds import (StorageOptions, TierSetupError, build_storages, check_tiers,
                            peek_recovered)
from kvstrata.kinds.base import layout_config_for
from kvstrata.physical import FileOps
from kvstrata.physical.capacity import physical_memory
from kvstrata.physical.storage.disk import slab_stride
from kvstrata.physical.storage.disk_home import home_name
from kvstrata.tiers import TierKind

from physical.s3fault import FaultyS3  # tests/physical (tests/ is on sys.path)

pytestmark = pytest.mark.timeout(60)

BS = 4
MODEL = ModelGeometry(num_layers=2, kv_heads=2, head_dim=8, dtype="fp16")


def _config(disk_dir=None, **tiers) -> KvConfig:
    return KvConfig(block_size=BS, tiers={"G1": TierConfig(blocks=8), **tiers}, model=MODEL,
                    disk_dir=disk_dir)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> pathlib.Path:
    """tempfile's directory moved into tmp_path, so what a build leaves there is visible."""
    where = tmp_path / "systmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    return where


# ------------------------------------------------------------------ findings (fixed)
def test_connector_accepts_a_gpu_cache_larger_than_host_ram():
    """Was a bug (the review of the kinds refactor): the connector's check took vLLM's GPU KV
    cache for a CPU stand-in and refused an engine whose GPU cache is larger than host RAM.
    The engine supplies G1's memory (``StorageOptions.engine_kv``): it is not checked."""
    from kvstrata.connectors.vllm.settings import KvGeometry, settings_from

    ram = physical_memory()
    if not ram:
        pytest.skip("this machine does not say how much RAM it has")
    block = 2 * 32 * 16 * 8 * 128 * 2            # 32 layers, 8 heads of 128, bf16: 2 MiB
    blocks = ram // block + 1                    # one GPU (or 8 ranks) > this host's RAM
    geometry = KvGeometry(16, 32, 8, 128, "bfloat16", blocks)
    settings = settings_from({"tiers": {"G2": {"blocks": 8}}}, geometry, env={})
    assert settings.kv.tier_blocks("G1") == blocks


def test_manager_builds_a_disk_tier_whose_path_is_a_pathlib_path(tmp_path):
    """Was a bug (same review): a disk tier whose path is a ``pathlib.Path`` was refused
    ('path must be a string'), though ``disk_dir=Path(...)`` was accepted;
    ``KvConfig.directory_of`` now gives a str for either."""
    from kvstrata.manager import KvBlockManager

    config = _config(G2=TierConfig(blocks=8), G3=TierConfig(blocks=8, path=tmp_path / "g3"))
    manager = KvBlockManager(config)
    try:
        assert str(manager.engine.storage("G3").path).startswith(str(tmp_path / "g3"))
    finally:
        manager.close()


# ----------------------------------------------------------------------- refusals, words
def test_every_refusal_the_old_builders_made_is_still_made_with_its_words(tmp_path):
    """manager/storages.py and settings._check_runnable refused these; check_tiers must."""
    opts = StorageOptions()
    assert check_tiers(_config(G3=TierConfig(blocks=4)), opts) == [
        "tier G3 (disk) needs tier G2 (host): its blocks move through host RAM"]
    assert check_tiers(_config(G4=TierConfig(blocks=4, url="http://h:1/bkt")), opts) == [
        "tier G4 (object) needs tier G2 (host): its blocks move through host RAM"]
    assert check_tiers(_config(G2=TierConfig(blocks=4), G4=TierConfig(blocks=4)), opts) == [
        'tier G4 (object store) needs a url: tiers.G4.url = "http://host:port/bucket"']
    # an object store given apart needs no url
    assert check_tiers(_config(G2=TierConfig(blocks=4), G4=TierConfig(blocks=4)),
                       StorageOptions(object_store=object())) == []
    (limit,) = check_tiers(_config(G2=TierConfig(blocks=4)), StorageOptions(max_host_bytes=1))
    assert limit == ("G2 of 4 blocks needs 16.00 KiB of host RAM, over the limit of 1 B; "
                     "shrink tier G2")          # (was "0.00 GiB ... 0.00 GiB": issue 28)
    # exactly at the limit: 4 slots of 4 KiB (payload 256 B, stride aligned to 4 KiB)
    assert check_tiers(_config(G2=TierConfig(blocks=4)),
                       StorageOptions(max_host_bytes=4 * 4096)) == []
    assert check_tiers(_config(G2=TierConfig(blocks=4), G3=TierConfig(blocks=4, path=123)),
                       opts) == ["tier G3: path must be a string, got 123"]
    # a tier of no block (an unvalidated config: bytes under one block)
    zero = KvConfig(block_size=BS, model=MODEL,
                    tiers={"G1": TierConfig(blocks=8), "G2": TierConfig(bytes=10)})
    assert check_tiers(zero, opts) == [f"tier G2 holds no block of {zero.bytes_per_block} bytes"]
    # every problem at once, not the first only
    many = check_tiers(_config(G2=TierConfig(blocks=4), G3=TierConfig(blocks=4, path=1),
                               G4=TierConfig(blocks=4)), StorageOptions(max_host_bytes=1))
    assert len(many) == 3


def test_a_kind_without_a_module_is_named(monkeypatch):
    monkeypatch.delitem(kinds.KINDS, TierKind.OBJECT)
    problems = check_tiers(_config(G2=TierConfig(blocks=4), G4=TierConfig(blocks=4)),
                           StorageOptions())
    (problem,) = problems
    named, _, held = problem.partition("; kvstrata holds ")
    assert named == "no storage for tier(s) G4 (object) yet"
    assert sorted(held.removesuffix(" tiers").split(", ")) == ["device", "disk", "host"]


def test_ram_checks_for_host_and_a_cpu_stand_in_count_every_rank():
    ram = physical_memory()
    if not ram:
        pytest.skip("this machine does not say how much RAM it has")
    bpb = _config().bytes_per_block
    blocks = ram // bpb + 1
    (g1,) = check_tiers(KvConfig(block_size=BS, model=MODEL,
                                 tiers={"G1": TierConfig(blocks=blocks)}), StorageOptions())
    assert g1.startswith(f"tier G1 needs {blocks * bpb} bytes of RAM")
    # the engine's own tensors (or a device that is not the CPU) are not host RAM
    huge_g1 = KvConfig(block_size=BS, model=MODEL, tiers={"G1": TierConfig(blocks=blocks)})
    engine_kv = StorageOptions(engine_kv=True)
    assert check_tiers(huge_g1, engine_kv) == []
    on_gpu = check_tiers(huge_g1, StorageOptions(device="cuda:0"))
    assert on_gpu == ([] if torch.cuda.is_available() else
                      ["tier G1: device 'cuda:0' is not on this machine (0 CUDA device(s))"])
    half = ram // 4096 // 2 + 1                  # two ranks of these do not fit, one does
    host = _config(G2=TierConfig(blocks=half))
    assert check_tiers(host, engine_kv) == []
    (both,) = check_tiers(host, engine_kv, ranks=2)
    assert both.startswith("tier G2 (2 ranks) needs")


def test_disk_space_counts_the_slabs_every_rank_kept(tmp_path, monkeypatch):
    """A restart of 2 ranks reuses both their slabs; a non-durable build reuses none."""
    config = _config(disk_dir=str(tmp_path), G2=TierConfig(blocks=4), G3=TierConfig(blocks=100))
    one = 100 * slab_stride(layout_config_for(config, 1))
    monkeypatch.setattr(disk_kind, "free_disk_bytes", lambda d: one // 2)
    two = StorageOptions(world_size=2)
    (short,) = check_tiers(config, two, ranks=2)
    assert short.startswith(f"tier G3 (2 ranks) needs {2 * one} bytes of disk")
    for rank in (0, 1):
        home = tmp_path / home_name("G3", rank, two.compatibility(config, rank).fingerprint)
        home.mkdir()
        with open(home / "slab", "wb") as fh:
            fh.truncate(one)
        if rank == 0:    # rank 1's slab still missing: one slab short
            (short,) = check_tiers(config, two, ranks=2)
            assert f"needs {one} bytes of disk" in short
    assert check_tiers(config, two, ranks=2) == []
    assert check_tiers(config, two) == []                       # rank 0 alone
    assert check_tiers(config, StorageOptions(world_size=2, rank=1)) == []
    assert check_tiers(config, StorageOptions(world_size=2, durable_disk=False), ranks=2)
    # the slabs of a 2-rank run are not a 1-rank run's (another fingerprint): none reused
    assert check_tiers(config, StorageOptions(), ranks=1)


# ------------------------------------------------------------------- nothing left behind
class _NoSlab(FileOps):
    def open(self, path, flags, mode=0o600):
        raise OSError(28, "No space left on device")


def test_a_temporary_disk_directory_is_removed_when_its_slab_cannot_be_made(private_tmp):
    config = _config(G2=TierConfig(blocks=4), G3=TierConfig(blocks=4))
    with pytest.raises(TierSetupError, match="G3 in .*cannot open the slab"):
        build_storages(config, StorageOptions(file_ops=_NoSlab()))
    assert os.listdir(private_tmp) == []


def test_a_temporary_disk_directory_is_removed_when_a_later_tier_fails(private_tmp):
    from kvstrata.physical.storage.s3client import S3Config

    config = _config(G2=TierConfig(blocks=4), G3=TierConfig(blocks=4), G4=TierConfig(blocks=4))
    with FaultyS3("403") as server:
        store = S3Config(endpoint_url=server.endpoint_url, bucket="bkt", access_key="a",
                         secret_key="b", connect_timeout=0.3, read_timeout=0.3,
                         request_timeout=0.4, retries=0)
        with pytest.raises(TierSetupError, match="G4 at"):
            build_storages(config, StorageOptions(object_store=store))
    assert os.listdir(private_tmp) == []


def test_storages_close_removes_every_temporary_directory_once(private_tmp):
    built = build_storages(_config(G2=TierConfig(blocks=4), G3=TierConfig(blocks=4)),
                           StorageOptions())
    assert len(built.temp_dirs) == 1 and os.path.isdir(built.temp_dirs[0])
    built.close()
    built.close()
    assert os.listdir(private_tmp) == [] and built.temp_dirs == []


def test_a_refused_config_allocates_and_creates_nothing(private_tmp, tmp_path):
    named = tmp_path / "named"
    config = _config(disk_dir=str(named), G2=TierConfig(blocks=4), G3=TierConfig(blocks=4),
                     G4=TierConfig(blocks=4))                     # no url
    with pytest.raises(TierSetupError, match="needs a url"):
        build_storages(config, StorageOptions())
    assert os.listdir(private_tmp) == [] and not named.exists()


def test_a_manager_refused_while_building_leaves_no_temporary_directory(private_tmp):
    from kvstrata.manager import KvBlockManager, ManagerConfigError

    with pytest.raises(ManagerConfigError):
        KvBlockManager(_config(G2=TierConfig(blocks=4), G3=TierConfig(blocks=4)),
                       file_ops=_NoSlab())
    assert os.listdir(private_tmp) == []


# -------------------------------------------------------- durable or not, and peek_recovered
def _store_two_blocks(config: KvConfig, options: StorageOptions) -> None:
    built = build_storages(config, options)
    try:
        disk = built.by_tier["G3"]
        n = disk.config.block_bytes
        disk.write_blocks([0, 1], [np.full(n, 1, np.uint8), np.full(n, 2, np.uint8)], [11, 12],
                          parent_hashes=[None, 11], local_hashes=[101, 102])
    finally:
        built.close()


def test_peek_recovered_none_vs_empty_and_durable_disk_false(tmp_path, private_tmp):
    config = _config(disk_dir=str(tmp_path / "d"), G2=TierConfig(blocks=4),
                     G3=TierConfig(blocks=4))
    durable, scratch = StorageOptions(), StorageOptions(durable_disk=False)
    # a temporary slab keeps nothing: empty, not None
    assert peek_recovered(_config(G2=TierConfig(blocks=4), G3=TierConfig(blocks=4)),
                          durable, 0) == {}
    assert peek_recovered(config, durable, 0) is None          # nothing stored there yet
    _store_two_blocks(config, durable)
    assert peek_recovered(config, durable, 0) == {"G3": [(0, 11, None, 101), (1, 12, 11, 102)]}
    assert peek_recovered(config, durable, 1) is None          # another rank's home
    # durable_disk=False in a named directory: a scratch slab there, nothing recovered, and
    # peek agrees with what the build recovers (not the durable home's rows)
    assert peek_recovered(config, scratch, 0) == {}
    built = build_storages(config, scratch)
    try:
        assert built.recovered_rows() == {}
        slab = built.by_tier["G3"].path
        assert slab.parent == tmp_path / "d" and slab.name.endswith(".slab")
        assert built.temp_dirs == []
    finally:
        built.close()
    assert not slab.exists()
    built = build_storages(config, durable)       # the durable home is untouched
    try:
        assert built.recovered_rows() == {"G3": [(0, 11, None, 101), (1, 12, 11, 102)]}
    finally:
        built.close()


# ----------------------------------------------------------------------- the directory
def test_disk_dir_precedence_in_the_manager(tmp_path):
    from kvstrata.manager import KvBlockManager

    def where(config, **kw):
        manager = KvBlockManager(config, **kw)
        try:
            return manager.engine.storage("G3").path.parent.parent
        finally:
            manager.close()

    tiers = dict(G2=TierConfig(blocks=4), G3=TierConfig(blocks=4, path=str(tmp_path / "tier")))
    assert where(_config(**tiers)) == tmp_path / "tier"
    assert where(_config(disk_dir=str(tmp_path / "cfg"), **tiers)) == tmp_path / "cfg"
    assert where(_config(disk_dir=str(tmp_path / "cfg"), **tiers),
                 disk_dir=tmp_path / "kw") == tmp_path / "kw"
    assert where(_config(**tiers), disk_dir="") == tmp_path / "tier"     # "" names none


def test_disk_dir_precedence_in_the_connector(tmp_path):
    from kvstrata.connectors.vllm.settings import KvGeometry, settings_from

    geometry = KvGeometry(BS, 2, 2, 8, "float16", 8)
    toml = tmp_path / "kv.toml"
    toml.write_text(f'disk_dir = "{tmp_path / "toml"}"\n[tiers.G2]\nblocks = 4\n'
                    f"[tiers.G1]\nblocks = 8\n[tiers.G3]\nblocks = 4\n")
    env = {"KVSTRATA_DISK_DIR": str(tmp_path / "env")}

    def where(extra, env):
        return settings_from(extra, geometry, env=env).kv.directory_of("G3")

    assert where({"config": str(toml)}, {}) == str(tmp_path / "toml")
    assert where({"config": str(toml)}, env) == str(tmp_path / "env")
    assert where({"config": str(toml), "disk_dir": str(tmp_path / "x")}, env) \
        == str(tmp_path / "x")
    tiers = {"G2": {"blocks": 4}, "G3": {"blocks": 4, "path": str(tmp_path / "tier")}}
    assert where({"config": str(toml), "tiers": tiers}, env) == str(tmp_path / "tier")
    # Within the extra config itself, disk_dir wins over a disk tier's path, as
    # KvConfig.directory_of decides for any one config (was: the path won there only).
    assert where({"config": str(toml), "tiers": tiers, "disk_dir": str(tmp_path / "x")},
                 env) == str(tmp_path / "x")


def test_a_failed_build_leaves_the_callers_device_tier_open(tmp_path):
    """An engine connector wraps its KV cache as G1 itself (``StorageOptions.g1``): a build
    that fails on a later tier closes what it built, not the caller's G1, which the caller
    may use again (a retry) or close itself."""
    import torch

    from kvstrata.physical import DeviceStorage

    g1 = DeviceStorage.wrap([torch.zeros(2, 8, BS, MODEL.kv_heads * MODEL.head_dim,
                                         dtype=torch.float16)
                             for _ in range(MODEL.num_layers)], kv_layout="outer_contiguous",
                            page_size=BS)
    followed = _config(disk_dir=str(tmp_path / "none"), G2=TierConfig(blocks=4),
                       G3=TierConfig(blocks=4))
    with pytest.raises(TierSetupError, match="G3"):         # no writer's G3 to follow
        build_storages(followed, StorageOptions(g1=g1, follow_durable=True))
    assert not g1.closed
    built = build_storages(_config(G2=TierConfig(blocks=4)), StorageOptions(g1=g1))
    assert built.by_tier["G1"] is g1
    built.close()
    assert g1.closed


def test_the_vllm_connectors_defaults_hold_until_a_source_names_tiers_or_eviction(tmp_path):
    """Its G2 1 GiB, G3 4 GiB and lru stay unless kvstrata's file or environment names
    tiers or an eviction; an unrelated variable or a file of other keys changed them to the
    replay's built-in tiers (G2 4,000 blocks, G3 16,000) before."""
    from kvstrata.connectors.vllm.settings import DEFAULT_TIERS, KvGeometry, settings_from

    geometry = KvGeometry(16, 32, 8, 128, "bfloat16", 64)

    def chosen(env, extra=None):
        kv = settings_from(extra or {}, geometry, env=env).kv
        return {t: (c.blocks, c.bytes) for t, c in kv.tiers.items() if t != "G1"}, kv.eviction

    defaults = {t: (c.blocks, c.bytes) for t, c in DEFAULT_TIERS.items()}
    other_keys = tmp_path / "other.toml"
    other_keys.write_text('model_id = "m"\n')
    for env in ({}, {"DYN_KVBM_METRICS": "true"}, {"KVSTRATA_GARBAGE": "x"},
                {"KVSTRATA_CONFIG": str(other_keys)}):
        assert chosen(env) == (defaults, "lru"), env
    tiers, _ = chosen({"DYN_KVBM_CPU_CACHE_GB": "8"})          # sized within the defaults
    assert tiers == {**defaults, "G2": (None, 8 << 30)}
    named = tmp_path / "named.toml"
    named.write_text('eviction = "lfu"\n[tiers.G2]\nbytes = "2GiB"\n')     # G1 is vLLM's
    assert chosen({"KVSTRATA_CONFIG": str(named)}) == ({"G2": (None, 2 << 30)}, "lfu")
    only_g1 = tmp_path / "g1.toml"                # sizes the replay's G1: nothing of vLLM's
    only_g1.write_text('[tiers.G1]\nblocks = 8\n')
    assert chosen({"KVSTRATA_CONFIG": str(only_g1), "KVSTRATA_G1_BLOCKS": "9"}) == \
        (defaults, "lru")


def test_sglang_takes_its_tiers_from_kvstratas_own_file_and_environment(tmp_path):
    """Without tiers in the extra config, the TOML's and the environment's are used (the
    4 GiB G3 default overrode them before); G1 is the host pool whatever they say."""
    from kvstrata.connectors.sglang.host_pool import HostPoolView
    from kvstrata.connectors.sglang.settings import SGLangConfigError, kv_config, settings_from
    from kvstrata.config import ModelGeometry

    pool = HostPoolView(runs=[], geometry=ModelGeometry(num_layers=2, kv_heads=2, head_dim=8,
                                                        dtype="float16"),
                        page_size=16, pages=100, layout="layer_first")

    def tiers(extra, env):
        config = kv_config(settings_from({"interface_v1": 1, **extra}), pool, "m", env=env)
        return {t: (c.blocks, c.bytes) for t, c in config.tiers.items()}

    toml = tmp_path / "kv.toml"
    toml.write_text('[tiers.G2]\nbytes = "1GiB"\n[tiers.G3]\nbytes = "64GiB"\n')   # no G1
    assert tiers({"config": str(toml)}, {}) == {"G1": (100, None), "G2": (None, 1 << 30),
                                                "G3": (None, 64 << 30)}
    assert tiers({}, {"KVSTRATA_G3_BYTES": "64GiB"}) == {"G1": (100, None),
                                                         "G3": (None, 64 << 30)}
    assert tiers({}, {}) == {"G1": (100, None), "G3": (None, 4 << 30)}
    assert tiers({"tiers": "G3=8GiB"}, {"KVSTRATA_G3_BYTES": "64GiB"}) == \
        {"G1": (100, None), "G3": (None, 8 << 30)}               # the extra config wins
    with pytest.raises(SGLangConfigError, match="interface_v1"):
        settings_from({"interface_v1": "false"})
