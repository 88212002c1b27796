"""kvstrata.kinds: one module per kind of tier, found without a list; the transfer engine's
paths derived from what a storage is; one check of the tiers for every driver."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import torch

import kvstrata.kinds as kinds
from kvstrata.config import KvConfig, ModelGeometry, TierConfig
from kvstrata.kinds import KINDS, StorageOptions, check_tiers, cost_priors, kind_of
from kvstrata.physical import DeviceStorage, HostStorage, LayoutConfig, TransferEngine
from kvstrata.physical.checksum import block_checksum
from kvstrata.physical.errors import BlockFailure, FailureKind, raise_for_failures
from kvstrata.physical.pacing import ForwardPacer
from kvstrata.physical.storage.base import BlockStore, StorageStatus
from kvstrata.placement.costs import CostPrior
from kvstrata.protocol.layout import FullyContiguousLayout
from kvstrata.protocol.plans import Endpoint, TransferPlan
from kvstrata.tiers import TIERS, TierKind

BS = 4


def _geometry(blocks: int, alignment: int = 1) -> LayoutConfig:
    return LayoutConfig(num_blocks=blocks, num_layers=2, outer_dim=2, page_size=BS,
                        inner_dim=8, dtype="float16", alignment=alignment)


def test_every_kind_a_tier_uses_has_its_module_and_prior():
    assert {s.kind for s in TIERS} <= set(KINDS)
    for kind, module in KINDS.items():
        assert module.kind is kind
        assert isinstance(module.cost_prior, CostPrior)
        assert cost_priors()[kind] is module.cost_prior
    assert kind_of("G3") is KINDS[TierKind.DISK]


_REMOTE_MODULE = '''
from kvstrata.kinds.base import Kind
from kvstrata.placement.costs import CostPrior
from kvstrata.tiers import TierKind


class RemoteMemoryKind(Kind):
    kind = TierKind.REMOTE
    cost_prior = CostPrior(bandwidth=3e9, overhead=2e-3)
    through_host = True

    def build(self, tier, built, geometry, options):
        raise NotImplementedError


KIND = RemoteMemoryKind()
'''


def _discover_with(tmp_path, monkeypatch, name: str, source: str):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.setattr(kinds, "__path__", [*kinds.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, f"kvstrata.kinds.{name}", raising=False)
    try:
        return kinds._discover()
    finally:
        sys.modules.pop(f"kvstrata.kinds.{name}", None)


def test_a_new_kind_is_one_module_found_without_a_list(tmp_path, monkeypatch):
    """Giving remote memory (the kind tiers.py names without a backend) a module is all it
    takes for the registry and the cost model to know it."""
    found = _discover_with(tmp_path, monkeypatch, "remote_memory", _REMOTE_MODULE)
    assert set(found) == set(KINDS) | {TierKind.REMOTE}
    assert found[TierKind.REMOTE].cost_prior == CostPrior(3e9, 2e-3)
    assert found[TierKind.REMOTE].through_host


def test_two_modules_for_one_kind_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ImportError, match="two modules of kvstrata.kinds hold disk tiers"):
        _discover_with(tmp_path, monkeypatch, "another_disk",
                       _REMOTE_MODULE.replace("TierKind.REMOTE", "TierKind.DISK"))


class DictStore(BlockStore):
    """A block store in a dict, addressed by keys like an object store: what a new kind's
    storage has to be for the transfer engine to move its blocks."""

    kind = "object"

    def __init__(self, config: LayoutConfig, write_round: int | None = None) -> None:
        super().__init__(FullyContiguousLayout(config))
        self.objects: dict[str, tuple[int, int, bytes]] = {}
        self.write_round = write_round
        self.write_calls: list[int] = []

    def write_blocks(self, keys, sources, sequence_hashes, *, checksums=None,
                     parent_hashes=None, local_hashes=None):
        self.write_calls.append(len(keys))
        n = self.config.block_bytes
        sums = []
        for i, key in enumerate(keys):
            payload = bytes(sources[i][:n])
            known = checksums[i] if checksums is not None else None
            sums.append(known if known is not None else block_checksum(np.frombuffer(payload,
                                                                                       np.uint8)))
            self.objects[key] = (sequence_hashes[i], sums[-1], payload)
        return sums

    def read_blocks(self, keys, destinations, sequence_hashes):
        n = self.config.block_bytes
        sums: list[int | None] = []
        failures = []
        for i, key in enumerate(keys):
            seq, checksum, payload = self.objects.get(key, (None, None, b""))
            view = np.frombuffer(payload, np.uint8)
            if seq != sequence_hashes[i] or block_checksum(view) != checksum:
                failures.append(BlockFailure(i, -1, FailureKind.CHECKSUM_MISMATCH, key))
                sums.append(None)
                continue
            destinations[i][:n] = view
            sums.append(checksum)
        raise_for_failures("dict read", failures, len(keys), sums)
        return sums

    def status(self) -> StorageStatus:
        return StorageStatus(kind=self.kind, blocks=self.num_blocks,
                             block_bytes=self.config.block_bytes, bytes=0)

    def descriptors(self):
        return ()


def _tiers(store: DictStore) -> dict:
    g1 = DeviceStorage.allocate(_geometry(8), device="cpu")
    for i, region in enumerate(g1.memory.regions):
        region.copy_(torch.randint(0, 256, region.shape, dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(i)))
    return {"G1": g1, "G2": HostStorage(_geometry(8, 4096), verify_reads=True), "G4": store}


def _payload(storage, block_id: int) -> bytes:
    return storage.block_view(block_id).contiguous().view(torch.uint8).numpy().tobytes()


def test_a_block_store_of_any_kind_gets_its_paths_derived():
    """The engine lists no handler per pair of kinds: a store that reads and writes blocks
    by key is stored into from host RAM and loaded into host RAM or, through staging, into
    device memory; never written from device memory or onboarded into."""
    store = DictStore(_geometry(64))
    tiers = _tiers(store)
    seqs = [101, 102, 103]
    keys = [f"k{h}" for h in seqs]
    with TransferEngine(tiers) as engine:
        assert set(engine.paths) == {"G1->G2", "G2->G1", "G2->G4", "G4->G2", "G4->G1"}

        def run(plan):
            return engine.submit(plan).result(timeout=30)

        assert run(TransferPlan.for_path("G1->G2", [0, 1, 2], [5, 6, 7], seqs, job_id=1)).all_ok
        stored = run(TransferPlan(2, Endpoint("G2"), Endpoint("G4"), seqs,
                                  src_block_ids=(5, 6, 7), dst_keys=tuple(keys)))
        assert stored.all_ok and sorted(store.objects) == sorted(keys)
        # the checksum G2 took travels to the store: no second hash, the same value
        assert list(stored.checksums) == tiers["G2"].checksums.checksums_of([5, 6, 7])
        loaded = run(TransferPlan(3, Endpoint("G4"), Endpoint("G1"), seqs,
                                  src_keys=tuple(keys), dst_block_ids=(3, 4, 5)))
        assert loaded.all_ok
        for src, dst in ((0, 3), (1, 4), (2, 5)):
            assert _payload(tiers["G1"], dst) == _payload(tiers["G1"], src)
        # a block that is not what it claims fails alone; the others arrive in G2
        store.objects["k102"] = (102, 1, store.objects["k102"][2])
        back = run(TransferPlan(4, Endpoint("G4"), Endpoint("G2"), seqs,
                                src_keys=tuple(keys), dst_block_ids=(0, 1, 2)))
        assert back.ok == (True, False, True)
        assert back.failures[0].kind is FailureKind.CHECKSUM_MISMATCH


def test_a_store_that_writes_in_rounds_is_paced_per_round():
    """With a forward pacer, writes into a store wait at the gate once per ``write_round``
    blocks (an object store's PUTs), from the store's own declaration."""
    store = DictStore(_geometry(64), write_round=2)
    tiers = _tiers(store)
    seqs = [11, 12, 13, 14, 15]
    pacer = ForwardPacer()
    with TransferEngine(tiers, pacer=pacer) as engine:
        assert engine.submit(TransferPlan.for_path("G1->G2", [0, 1, 2, 3, 4], [0, 1, 2, 3, 4],
                                                   seqs, job_id=1)).result(timeout=30).all_ok
        result = engine.submit(TransferPlan(2, Endpoint("G2"), Endpoint("G4"), seqs,
                                            src_block_ids=(0, 1, 2, 3, 4),
                                            dst_keys=tuple(f"k{h}" for h in seqs))
                               ).result(timeout=30)
    assert result.all_ok
    assert store.write_calls == [2, 2, 1]


def _config(**tiers) -> KvConfig:
    return KvConfig(block_size=BS, tiers={"G1": TierConfig(blocks=8), **tiers},
                    model=ModelGeometry(num_layers=2, kv_heads=2, head_dim=8, dtype="fp16"))


def test_one_check_of_the_tiers_for_every_driver(tmp_path):
    """The manager and the vLLM connector refuse the same tiers with the same words: both
    ask check_tiers (was: the rules written in both)."""
    pytest.importorskip("vllm")
    from kvstrata.connectors.vllm.settings import ConnectorConfigError, KvGeometry, settings_from
    from kvstrata.manager import KvBlockManager, ManagerConfigError

    no_host = _config(G3=TierConfig(blocks=4))
    problems = check_tiers(no_host, StorageOptions())
    assert problems == ["tier G3 (disk) needs tier G2 (host): its blocks move through host RAM"]
    with pytest.raises(ManagerConfigError) as refused:
        KvBlockManager(no_host, disk_dir=tmp_path)
    assert problems[0] in str(refused.value)
    geometry = KvGeometry(BS, 2, 2, 8, "float16", 8)
    with pytest.raises(ConnectorConfigError) as refused:
        settings_from({"tiers": {"G3": {"blocks": 4}}}, geometry, env={})
    assert problems[0] in str(refused.value)

    no_url = _config(G2=TierConfig(blocks=4), G4=TierConfig(blocks=4))
    assert check_tiers(no_url, StorageOptions()) == [
        'tier G4 (object store) needs a url: tiers.G4.url = "http://host:port/bucket"']
    huge = _config(G2=TierConfig(blocks=2**31 - 3))
    (ram,) = check_tiers(huge, StorageOptions())
    assert ram.startswith("tier G2 needs") and "of RAM" in ram
    (both,) = check_tiers(_config(G2=TierConfig(blocks=2**30)), StorageOptions(), ranks=2)
    assert both.startswith("tier G2 (2 ranks) needs")


def test_a_disk_directory_that_cannot_be_one_is_refused_before_anything_is_made(tmp_path):
    """Issue 28: a disk_dir that is a regular file (or under one), or holds a NUL byte, is one
    ManagerConfigError naming it, found before anything is allocated."""
    from kvstrata.manager import KvBlockManager, ManagerConfigError

    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    config = _config(G2=TierConfig(blocks=4), G3=TierConfig(blocks=4))
    for where, words in ((afile, "is not a directory"), (afile / "sub", "is not a directory"),
                         ("/tmp/a\0b", "contains a NUL byte")):
        with pytest.raises(ManagerConfigError, match=words):
            KvBlockManager(config, disk_dir=where)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
