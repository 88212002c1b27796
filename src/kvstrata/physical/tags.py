"""Keyed tags of blocks stored at rest (G3 files, G4 objects): who cannot hold the key
cannot make a block that passes as ours.

A stored block's xxh3-64 checksum catches damage, but anyone who can write the file or the
bucket can recompute it for bytes of their choosing. Its *tag* is a keyed BLAKE3 hash,
truncated to 64 bits, of the block's identity (its tier's compatibility fingerprint and its
sequence hash: a genuine block moved under another name or model fails) and its payload. The
key is derived from the deployment's secret (:mod:`kvstrata.secret`) for this one purpose, so
a forger needs the secret; a guess passes once in 2^64.

Where the tag is kept and checked: :mod:`~.storage.disk_index` and
:class:`~.storage.disk.DiskStorage` (one per index record, checked on every read from the
slab), :mod:`~.storage.object_format` (in the object's header, checked on every get). A
tier's files or objects written under another key, or none, are not read as its blocks.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..secret import derive_key, resolve_secret

__all__ = ["BlockTagger", "tagger_from_environment", "TAG_PURPOSE"]

TAG_PURPOSE = "kvstrata 2026-11-27 stored block tags v1"
"""The key derivation context of stored-block tags (a new one re-keys every stored block)."""


class BlockTagger:
    """Tags stored blocks with one key (see the module docstring)."""

    def __init__(self, key: bytes) -> None:
        import blake3

        if not isinstance(key, bytes) or len(key) != 32:
            raise ValueError("a block tag key is 32 bytes")
        self._blake3 = blake3.blake3
        self._key = key
        self.key_id = int.from_bytes(
            blake3.blake3(key, derive_key_context="kvstrata block tag key id").digest(8),
            "little") or 1
        """A public name of the key (never 0: 0 stands for "no key") that says, without
        revealing it, whether files were tagged under this key."""

    @classmethod
    def from_secret(cls, secret: bytes) -> "BlockTagger":
        return cls(derive_key(secret, TAG_PURPOSE))

    def tag(self, identity: bytes, sequence_hash: int, payload) -> int:
        """The tag of ``payload`` stored as block ``sequence_hash`` under ``identity`` (the
        tier's fingerprint, or a G4 header's fields)."""
        h = self._blake3(key=self._key)
        h.update(len(identity).to_bytes(4, "little"))
        h.update(identity)
        h.update(sequence_hash.to_bytes(8, "little"))
        h.update(payload)
        return int.from_bytes(h.digest(8), "little")

    def tags(self, identity: bytes, sequence_hashes: Sequence[int],
             payloads: Sequence) -> list[int]:
        return [self.tag(identity, s, p) for s, p in zip(sequence_hashes, payloads)]


def tagger_from_environment(env: Mapping[str, str] | None = None) -> BlockTagger | None:
    """The tagger of the deployment's secret, or None when no secret is set
    (:class:`~kvstrata.secret.SecretError` when one is set but unusable)."""
    secret = resolve_secret(env=env)
    return None if secret is None else BlockTagger.from_secret(secret)
