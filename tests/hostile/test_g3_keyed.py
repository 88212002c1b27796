"""Issue 27: a durable G3 keyed with the deployment's secret. Someone who can write its slab
and index but does not hold the secret rewrites a block and journals it with a correct xxh3
(finding 3's attack): the block is refused, never served; a block relabelled as another
sequence, or journaled with another checksum, is refused; a restart under another key, or
none, is refused and leaves the tier as it was; the same key recovers and serves
everything untouched."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from kvstrata.physical.errors import StorageConfigError
from kvstrata.physical.storage.disk_index import DiskIndex
from kvstrata.physical.tags import BlockTagger

from ._util import FP, PUT, home_of, open_durable, read_ok, record, write

SEQS = [0x1111, 0x2222, 0x3333, 0x4444]
KEY = BlockTagger.from_secret(b"the deployment's secret, 32 bytes")
OTHER_KEY = BlockTagger.from_secret(b"another deployment's secret, 32b")


def _stored(tmp_path):
    disk = open_durable(tmp_path, tagger=KEY)
    write(disk, [0, 1, 2, 3], SEQS)
    stride, block_bytes = disk.layout.block_stride, disk.config.block_bytes
    disk.close()
    return home_of(tmp_path), stride, block_bytes


def _live_tags(home) -> dict[int, int]:
    live = DiskIndex.peek(home / "index", capacity=16, fingerprint=FP, stride=4096,
                          key_id=KEY.key_id)
    return dict(zip(live.slots.tolist(), live.tags.tolist()))


def test_a_block_rewritten_and_journaled_without_the_key_is_refused(tmp_path):
    home, stride, block_bytes = _stored(tmp_path)
    tags = _live_tags(home)
    assert len(tags) == 4 and all(tags.values())
    forged = bytes(block_bytes)                              # zeros, their own xxh3
    with open(home / "slab", "r+b") as slab:
        slab.seek(2 * stride)
        slab.write(forged)
    with open(home / "index", "ab") as index:               # a fresh record, xxh3 and all;
        index.write(record(PUT, 2, SEQS[2], SEQS[1],        # the tag it cannot make
                           checksum=xxhash.xxh3_64_intdigest(forged), tag=tags[2]))
    disk = open_durable(tmp_path, tagger=KEY)
    try:
        assert len(disk.recovered) == 4
        assert not read_ok(disk, 2, SEQS[2])
        assert all(read_ok(disk, slot, SEQS[slot]) for slot in (0, 1, 3))
    finally:
        disk.close()


def test_a_genuine_block_relabelled_as_another_sequence_is_refused(tmp_path):
    home, stride, block_bytes = _stored(tmp_path)
    tags = _live_tags(home)
    with open(home / "slab", "rb") as slab:
        slab.seek(0)
        genuine = slab.read(block_bytes)
    with open(home / "index", "ab") as index:               # slot 0's bytes and tag, named
        index.write(record(PUT, 5, 0x5555, SEQS[3],         # as a block of another prefix
                           checksum=xxhash.xxh3_64_intdigest(genuine), tag=tags[0]))
    with open(home / "slab", "r+b") as slab:
        slab.seek(5 * stride)
        slab.write(genuine)
    disk = open_durable(tmp_path, tagger=KEY)
    try:
        assert not read_ok(disk, 5, 0x5555)
        assert read_ok(disk, 0, SEQS[0])
    finally:
        disk.close()


def test_another_key_or_none_is_refused_and_destroys_nothing(tmp_path):
    """A start with a missing or wrong secret (a secret file that failed to mount, say) is a
    typed error naming the directory, and leaves it as it was: the next start with the right
    secret serves every block."""
    home, _, _ = _stored(tmp_path)
    before = {name: (home / name).read_bytes() for name in ("index", "slab")}
    for tagger, why in ((OTHER_KEY, "another one is set now"), (None, "none is set now")):
        with pytest.raises(StorageConfigError, match=why):
            open_durable(tmp_path, tagger=tagger)
        assert {name: (home / name).read_bytes() for name in before} == before
    disk = open_durable(tmp_path, tagger=KEY)
    try:
        assert len(disk.recovered) == 4
        assert all(read_ok(disk, slot, seq) for slot, seq in enumerate(SEQS))
    finally:
        disk.close()


def test_a_journal_record_with_a_swapped_checksum_is_refused(tmp_path):
    """The tag covers the recorded checksum. Bytes that rotted in G2 before they were
    written are tagged as they are but recorded with G2's checksum of the good bytes (so a
    read refuses them); rewriting only the record's checksum to the rotten bytes' own xxh3
    does not make them pass."""
    from ._util import blocks_for, payload_of

    disk = open_durable(tmp_path, tagger=KEY)
    _keep, views = blocks_for(disk, [SEQS[0]])
    good = xxhash.xxh3_64_intdigest(payload_of(SEQS[0], disk.config.block_bytes).tobytes())
    views[0][:16] ^= 0xFF                                   # rotted in G2 after its checksum
    disk.write_blocks([0], views, [SEQS[0]], checksums=[good], parent_hashes=[None],
                      local_hashes=[1])
    rotten = views[0][:disk.config.block_bytes].tobytes()
    tag = int(disk._tags[0])
    disk.close()
    home = home_of(tmp_path)
    with open(home / "index", "ab") as index:
        index.write(record(PUT, 0, SEQS[0], None, local=1,
                           checksum=xxhash.xxh3_64_intdigest(rotten), tag=tag))
    disk = open_durable(tmp_path, tagger=KEY)
    try:
        assert not read_ok(disk, 0, SEQS[0])
    finally:
        disk.close()


def test_an_unkeyed_index_is_not_read_under_a_key(tmp_path):
    disk = open_durable(tmp_path)                            # no secret when it was written
    write(disk, [0, 1], SEQS[:2])
    disk.close()
    disk = open_durable(tmp_path, tagger=KEY)
    try:
        assert len(disk.recovered) == 0 and "kept without a key" in " ".join(disk.notes)
    finally:
        disk.close()


def test_tags_cost_one_keyed_pass_and_the_bytes_round_trip(tmp_path):
    """The tagged path moves the same bytes as the unkeyed one (random payloads, 4 slots)."""
    disk = open_durable(tmp_path, tagger=KEY)
    try:
        write(disk, [0, 1, 2, 3], SEQS)
        assert all(read_ok(disk, slot, seq) for slot, seq in enumerate(SEQS))
        assert np.count_nonzero(disk._tags[:4]) == 4 and not disk._tags[4:].any()
    finally:
        disk.close()
    assert os.stat(home_of(tmp_path) / "index").st_mode & 0o077 == 0


# -- encryption at rest ------------------------------------------------------------------------

from kvstrata.physical.tags import BlockCipher  # noqa: E402

CIPHER = BlockCipher.from_secret(b"the deployment's secret, 32 bytes")
OTHER_CIPHER = BlockCipher.from_secret(b"another deployment's secret, 32b")


def _encrypted(tmp_path, **kw):
    return open_durable(tmp_path, tagger=KEY, cipher=CIPHER, encrypt=True, **kw)


def test_encrypted_blocks_never_reach_the_disk_in_clear_and_come_back(tmp_path):
    from ._util import payload_of

    disk = _encrypted(tmp_path)
    write(disk, [0, 1, 2, 3], SEQS)
    block_bytes = disk.config.block_bytes
    assert all(read_ok(disk, slot, seq) for slot, seq in enumerate(SEQS))
    disk.close()
    slab = (home_of(tmp_path) / "slab").read_bytes()
    for seq in SEQS:
        plain = payload_of(seq, block_bytes).tobytes()
        assert plain[:64] not in slab and plain[-64:] not in slab
    disk = _encrypted(tmp_path)                     # recovered, decrypted, verified
    try:
        assert len(disk.recovered) == 4
        assert all(read_ok(disk, slot, seq) for slot, seq in enumerate(SEQS))
    finally:
        disk.close()
    # encryption turned off: what was stored encrypted is still read (the key is there)
    disk = open_durable(tmp_path, tagger=KEY, cipher=CIPHER)
    try:
        assert all(read_ok(disk, slot, seq) for slot, seq in enumerate(SEQS))
    finally:
        disk.close()


def test_a_flipped_ciphertext_byte_or_a_swapped_seal_is_refused(tmp_path):
    disk = _encrypted(tmp_path)
    write(disk, [0, 1, 2, 3], SEQS)
    stride = disk.layout.block_stride
    disk.close()
    home = home_of(tmp_path)
    with open(home / "slab", "r+b") as slab:
        slab.seek(stride + 100)
        byte = slab.read(1)
        slab.seek(stride + 100)
        slab.write(bytes([byte[0] ^ 1]))
    live = DiskIndex.peek(home / "index", capacity=16, fingerprint=FP, stride=4096,
                          key_id=KEY.key_id)
    seal_of = dict(zip(live.slots.tolist(), (s.tobytes() for s in live.seals)))
    checksum_of = dict(zip(live.slots.tolist(), live.checksums.tolist()))
    with open(home / "index", "ab") as index:         # slot 3 journaled with slot 2's seal
        index.write(record(PUT, 3, SEQS[3], SEQS[2], checksum=checksum_of[3],
                           seal=seal_of[2]))
    disk = _encrypted(tmp_path)
    try:
        assert not read_ok(disk, 1, SEQS[1]) and not read_ok(disk, 3, SEQS[3])
        assert read_ok(disk, 0, SEQS[0]) and read_ok(disk, 2, SEQS[2])
    finally:
        disk.close()


def test_an_encrypted_block_under_another_key_or_no_cipher_is_refused(tmp_path):
    disk = _encrypted(tmp_path)
    write(disk, [0], SEQS[:1])
    try:
        disk._cipher = OTHER_CIPHER                    # the same index, another key
        assert not read_ok(disk, 0, SEQS[0])
    finally:
        disk.close()
    disk = _encrypted(tmp_path)
    write(disk, [0], SEQS[:1])
    try:
        disk._cipher = None
        assert not read_ok(disk, 0, SEQS[0])
    finally:
        disk.close()


def test_turning_encryption_on_drops_the_blocks_kept_in_clear(tmp_path):
    disk = open_durable(tmp_path, tagger=KEY, cipher=CIPHER)          # in clear, tagged
    write(disk, [0, 1, 2, 3], SEQS)
    disk.close()
    disk = _encrypted(tmp_path)
    try:
        assert len(disk.recovered) == 0
        assert "dropped 4 blocks kept in clear" in " ".join(disk.notes)
        assert not read_ok(disk, 0, SEQS[0])
    finally:
        disk.close()


def test_a_block_that_fails_to_decrypt_leaves_zeros_not_plaintext(tmp_path):
    from kvstrata.physical.buffers import AlignedBuffer
    from kvstrata.physical.errors import BlockIOError

    disk = _encrypted(tmp_path)
    write(disk, [0], SEQS[:1])
    stride = disk.layout.block_stride
    try:
        with open(disk.path, "r+b") as slab:                  # one ciphertext bit flipped
            slab.seek(100)
            byte = slab.read(1)
            slab.seek(100)
            slab.write(bytes([byte[0] ^ 1]))
        buf = AlignedBuffer(stride)
        with pytest.raises(BlockIOError):
            disk.read_blocks([0], [buf.array[:stride]], [SEQS[0]])
        assert not buf.array[:disk.config.block_bytes].any()
    finally:
        disk.close()
