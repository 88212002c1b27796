"""Hostile tests of the G4 object store's own behaviour on a real S3 server (SeaweedFS
``weed mini``): loads queued behind stores, names in the bucket that are not kvstrata's (junk,
forged keys, a key made a directory), a block whose bytes changed after it was hashed, and
the listing of every rank's namespace."""

from __future__ import annotations

import secrets
import threading
import time
import uuid

import numpy as np
import pytest

from kvstrata.manager import KvBlockManager
from kvstrata.manager.catalog import StoreLister
from kvstrata.physical import LayoutConfig
from kvstrata.physical.checksum import block_checksum
from kvstrata.physical.errors import BlockIOError, ChecksumMismatchError
from kvstrata.physical.storage.objects import ObjectStorage
from kvstrata.physical.storage.s3client import S3Client
from kvstrata.physical.tags import keys_at_rest
from kvstrata.placement.keys import block_key, chain_consistent
from kvstrata.tokens import hash_blocks, isolation_seed
from kvstrata.types import BlockRecord

from ._util import BS, small_manager_config

from test_manager import HANG_GUARD, assert_g1_bytes, chain, hashes_of, payloads, put  # noqa

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LAYOUT = LayoutConfig(num_blocks=64, num_layers=1, outer_dim=2, page_size=BS, inner_dim=32,
                      dtype="float16")
BB = LAYOUT.block_bytes


def _namespace() -> str:
    return f"g4store/{uuid.uuid4().hex[:10]}"


def _store(s3, namespace=None, **kw) -> ObjectStorage:
    return ObjectStorage(LAYOUT, s3, namespace=namespace or _namespace(), fingerprint="fp",
                         **kw)


def _block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BB, dtype=np.uint8)


def _write(store: ObjectStorage, records, seed: int = 0) -> dict[str, np.ndarray]:
    """Store a block for each record under its key; its bytes by key."""
    data = {block_key(r): _block(seed + i) for i, r in enumerate(records)}
    store.write_blocks(list(data), list(data.values()), [r.sequence_hash for r in records])
    return data


def _seeded_chain(n: int, start: int) -> list[BlockRecord]:
    """A chain hashed with a LoRA adapter's seed: its keys do not follow the default-seed
    rule, like a forger's."""
    local, seqs = hash_blocks(list(range(start, start + n * BS)), BS, isolation_seed("lora-x"))
    return [BlockRecord(s, lo, p, BS) for s, lo, p in zip(seqs, local, [None, *seqs[:-1]])]


# --------------------------------------------------------------------------- request pools
class _Slow(S3Client):
    """A remote store: each PUT (or GET) takes ``delay`` seconds more."""

    def __init__(self, config, *, put_delay=0.0, get_delay=0.0):
        super().__init__(config)
        self.put_delay, self.get_delay = put_delay, get_delay

    def put_if_absent(self, key, body):
        time.sleep(self.put_delay)
        return super().put_if_absent(key, body)

    def get(self, key, *, max_bytes=None):
        time.sleep(self.get_delay)
        return super().get(key, max_bytes=max_bytes)


def _short(weed):
    # per request (no retries): 0.25 + 0.5 + 0.5 s; a lone 1-block batch: 2.25 s
    return weed.s3_config(connect_timeout=0.25, request_timeout=0.5, retries=0)


def _in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_load_does_not_wait_behind_a_store_batch(weed):
    """(Was a bug: one pool for GETs and PUTs, so a 1-block load queued behind a 16-block
    store, 3.2 s of healthy PUTs, and failed at its own 2.25 s deadline.)"""
    store = _store(_Slow(_short(weed), put_delay=0.4), max_concurrency=2)
    want = _block(1)
    key = "0000000000000001.0000000000000001.root"
    store.write_blocks([key], [want], [1])
    keys = [f"{0x100 + i:016x}.{i:016x}.root" for i in range(16)]
    writer, written = _in_thread(lambda: store.write_blocks(
        keys, [_block(100 + i) for i in range(16)], list(range(0x100, 0x110))))
    time.sleep(0.1)                                   # the store batch fills its pool
    out = np.zeros(BB, np.uint8)
    began = time.monotonic()
    store.read_blocks([key], [out], [1])
    assert time.monotonic() - began < 1.0 and np.array_equal(out, want)
    writer.join(HANG_GUARD)
    assert not isinstance(written[0], BaseException), written[0]
    store.close()


def test_a_batch_queued_behind_another_on_its_pool_is_not_failed_by_that_wait(weed):
    """Two loads at once (G4->G1 and G4->G2 paths) share the read pool; the second's
    deadline must count the requests queued ahead of it."""
    store = _store(_Slow(_short(weed), get_delay=0.4), max_concurrency=2)
    keys = [f"{0x200 + i:016x}.{i:016x}.root" for i in range(17)]
    data = dict(zip(keys, (_block(200 + i) for i in range(17))))
    store.write_blocks(keys, list(data.values()), list(range(0x200, 0x211)))
    big, small = keys[:16], keys[16]
    reader, read = _in_thread(lambda: store.read_blocks(
        big, [np.zeros(BB, np.uint8) for _ in big], list(range(0x200, 0x210))))
    time.sleep(0.1)
    out = np.zeros(BB, np.uint8)
    store.read_blocks([small], [out], [0x210])        # 3.2 s of GETs ahead of it
    assert np.array_equal(out, data[small])
    reader.join(HANG_GUARD)
    assert not isinstance(read[0], BaseException), read[0]
    store.close()


# --------------------------------------------------------------------------- poisoned bytes
@pytest.mark.parametrize("encrypt", [False, True])
def test_a_block_whose_bytes_changed_since_it_was_hashed_is_not_stored(weed, encrypt):
    """(Was a bug: stored under the recorded checksum, an object every read fails and no
    worker can replace: PUTs write absent keys only.)"""
    keys = keys_at_rest(secrets.token_bytes(32))
    namespace = _namespace()

    def open_store():
        return _store(weed.s3_config(), namespace, tagger=keys.tagger,
                      cipher=keys.cipher if encrypt else None, encrypt=encrypt)

    good = _block(7)
    recorded = block_checksum(good)
    bad = good.copy()
    bad[100] ^= 0x04                                   # one bit flips in worker A's G2
    key = "00000000000000aa.00000000000000aa.root"
    a, b = open_store(), open_store()
    with pytest.raises(ChecksumMismatchError) as err:
        a.write_blocks([key], [bad], [0xAA], checksums=[recorded])
    assert list(err.value.checksums) == [None] and a.counters.puts == 0
    assert a.exists([key]) == [False]
    assert b.write_blocks([key], [good], [0xAA], checksums=[recorded]) == [recorded]
    assert b.counters.puts == 1
    out = np.zeros(BB, np.uint8)
    assert open_store().read_blocks([key], [out], [0xAA]) == [recorded]
    assert np.array_equal(out, good)


# --------------------------------------------------------------------------- names
def test_junk_names_do_not_count_toward_the_listing_limit(weed):
    """(Was a bug: ``limit`` names sorting before hex hid every block from the catalog.)"""
    store = _store(weed.s3_config())
    records = chain(4, start=9000)
    _write(store, records)
    client = S3Client(weed.s3_config())
    for i in range(8):                                 # '-' and '.' sort before any hex
        client.put(store.namespace + f"-junk{i}", b"")
        client.put(store.namespace + f".{i}", b"")
    lister = StoreLister(store, "G4", BS, lambda *a: None, None, limit=4)
    assert set(lister.records()) == set(records)
    store.close()


def _manager(weed, tenant) -> KvBlockManager:
    config = small_manager_config(g1=8, g2=8, g3=0, g4=256, tenant=tenant)
    return KvBlockManager(config, object_store=weed.s3_config(), list_interval=None)


def _onboard(mgr, records, data):
    with mgr.onboard(hashes_of(records)).result(HANG_GUARD) as loaded:
        assert_g1_bytes(mgr, loaded, data)
        return len(loaded), [f.kind for f in loaded.failures]


def test_a_forged_first_block_key_does_not_shadow_the_real_one(weed):
    """An empty object ``<seq>.0000000000000000.root`` sorts before the real key of that
    sequence hash. (Was a bug: the first key listed won, every load of the chain failed,
    and every listing learned it again.)"""
    tenant = f"t{uuid.uuid4().hex[:10]}"
    records = chain(4, start=9100)
    with _manager(weed, tenant) as writer:
        data = payloads(writer, records)
        put(writer, records, data)
        writer.wait_idle(HANG_GUARD)
        ns = writer.storage("G4").namespace
    fake = BlockRecord(records[0].sequence_hash, 0, None, BS)
    assert block_key(fake) < block_key(records[0]) and not chain_consistent(fake)
    S3Client(weed.s3_config()).put(ns + block_key(fake), b"")
    with _manager(weed, tenant) as reader:
        assert reader.refresh_catalogs() == 4
        assert reader.locate(hashes_of(records)).result(HANG_GUARD) == ["G4"] * 4
        assert _onboard(reader, records, data) == (4, [])


def test_learn_keeps_the_record_that_follows_the_chaining_rule(weed):
    """Several records for one block in one ``learn`` (events, a listing): the consistent
    one is kept, whichever comes first."""
    tenant = f"t{uuid.uuid4().hex[:10]}"
    records = chain(3, start=9200)
    fake = BlockRecord(records[1].sequence_hash, 12345, records[0].sequence_hash, BS)
    with _manager(weed, tenant) as reader:             # started empty: learns only below
        with _manager(weed, tenant) as writer:
            data = payloads(writer, records)
            put(writer, records, data)
            writer.wait_idle(HANG_GUARD)
        learned = reader.learn("G4", [records[0], fake, records[1], records[2]])
        assert learned.result(HANG_GUARD) == 3
        assert _onboard(reader, records, data) == (3, [])


def test_a_key_whose_object_was_found_bad_is_not_listed_again(weed):
    """A forged key ties with the real one (a LoRA chain follows no default-seed rule) and
    sorts first: the first listing may hand it on; once a load found its object bad, no
    later listing does, so the real key is learned. (Was a bug: the first key listed won,
    every time.)"""
    store = _store(weed.s3_config())
    records = _seeded_chain(3, start=9300)
    _write(store, records)
    victim = records[1]
    fake = BlockRecord(victim.sequence_hash, 0, victim.parent_hash, BS)
    assert block_key(fake) < block_key(victim)
    assert not chain_consistent(fake) and not chain_consistent(victim)
    S3Client(weed.s3_config()).put(store.namespace + block_key(fake), b"")
    lister = StoreLister(store, "G4", BS, lambda *a: None, None)

    def offered():
        lister.listings += 1                  # as refresh() counts them
        return [r for r in lister.records() if r.sequence_hash == victim.sequence_hash]

    assert offered() in ([fake], [victim])
    with pytest.raises(BlockIOError) as err:
        store.read_blocks([block_key(fake)], [np.zeros(BB, np.uint8)], [fake.sequence_hash])
    assert err.value.failures[0].kind == "hash_mismatch" and store.found_bad(block_key(fake))
    assert [offered() for _ in range(4)] == [[victim]] * 4
    store.close()


def test_a_put_to_a_key_made_a_directory_is_not_counted_as_stored(weed):
    """SeaweedFS: an object ``<key>/x`` makes ``<key>`` a directory, and a conditional PUT
    of ``<key>`` answers 412 though nothing is there. (Was a bug: counted as stored by
    someone else, the block's copy "succeeded" and every load of it missed.)"""
    store = _store(weed.s3_config())
    key = "00000000000000bb.00000000000000bb.root"
    S3Client(weed.s3_config()).put(store.namespace + key + "/x", b"junk")
    with pytest.raises(BlockIOError) as err:
        store.write_blocks([key], [_block(3)], [0xBB])
    failure = err.value.failures[0]
    assert failure.kind == "io_error" and "holds no object" in failure.detail
    assert store.counters.puts_skipped_existing == 0 and store.counters.failures == 1
    store.close()


# --------------------------------------------------------------------------- ranks
def test_other_ranks_are_listed_only_as_far_as_the_first_ranks_last_key(weed):
    """(Was a bug: every other rank's namespace was read in full, every interval: memory
    and time grew with the bucket, not with the catalog.)"""
    base = _namespace()
    r0 = _store(weed.s3_config(), base + "/r0")
    r1 = _store(weed.s3_config(), base + "/r1")
    client = S3Client(weed.s3_config())
    both = [f"{i:016x}.{i:016x}.root" for i in range(1, 6)]
    for key in both:
        client.put(r0.namespace + key, b"")
    for key in both[:2] + both[3:]:                    # rank 1 lacks one of them
        client.put(r1.namespace + key, b"")
    client.put(r1.namespace + both[0] + "/x", b"")     # a deeper name, listed in between
    client.put(r1.namespace + "-junk", b"")
    for i in range(200):                               # rank 1 holds much more, after them
        client.put(r1.namespace + f"{0xF000 + i:016x}.{0xF000 + i:016x}.root", b"")
    consumed = 0
    names = r1.client.list_keys

    def counted(prefix=""):
        nonlocal consumed
        for name in names(prefix):
            consumed += 1
            yield name

    r1.client.list_keys = counted
    lister = StoreLister([r0, r1], "G4", BS, lambda *a: None, None, limit=16)
    got = {block_key(r) for r in lister.records()}
    assert got == set(both) - {both[2]}
    assert consumed <= len(both) + 3                   # not the 200 beyond the last key
    r0.close()
    r1.close()


_CONFLICT = ("Generic S3 error: Client error with status code: 409 Conflict: "
             "ConditionalRequestConflict: A conflicting conditional operation is currently "
             "in progress against this resource.")


def _client_answering(answers, found):
    """An S3Client whose conditional PUTs get ``answers`` in turn (an exception to raise, or
    None: written) and whose HEAD finds the object iff ``found``. Returns (client, puts made).
    The store is faked: unit-level fault injection."""
    import types

    from kvstrata.physical.storage.s3client import S3Config

    client = S3Client(S3Config(endpoint_url="http://127.0.0.1:9", bucket="b"))
    real = client._obs
    puts = []

    def put(*args, **kwargs):
        answer = answers[min(len(puts), len(answers) - 1)]
        puts.append(kwargs.get("mode"))
        if answer is not None:
            raise answer

    def head(*args, **kwargs):
        if found:
            return {"size": 1}
        raise FileNotFoundError("Object at location k not found: status code: 404")

    client._obs = types.SimpleNamespace(put=put, head=head, exceptions=real.exceptions)
    return client, puts


def test_a_put_answered_409_throughout_is_another_writers_put_not_a_failure():
    """AWS answers 409 ConditionalRequestConflict while another writer's PUT of the key is
    in flight; the object is not visible yet, so a HEAD finds nothing. Asked again until the
    pauses run out, it is that writer's (the same bytes), not a key made a directory."""
    from kvstrata.physical.storage.s3client import CONFLICT_PAUSES

    client, puts = _client_answering([Exception(_CONFLICT)], found=False)
    assert client.put_if_absent("ns/k", b"x") is False
    assert puts == ["create"] * len(CONFLICT_PAUSES)


def test_a_put_answered_409_is_written_when_the_other_writer_failed():
    """The other writer's PUT failed (its conflict ended with nothing stored): the block is
    written by this one, not counted as stored when it is not."""
    client, puts = _client_answering([Exception(_CONFLICT), None], found=False)
    assert client.put_if_absent("ns/k", b"x") is True
    assert puts == ["create", "create"]


def test_a_put_answered_409_then_412_is_the_other_writers_object():
    client, puts = _client_answering(
        [Exception(_CONFLICT), Exception("Client error with status code: 412 Precondition "
                                         "Failed")], found=True)
    assert client.put_if_absent("ns/k", b"x") is False
    assert puts == ["create", "create"]
