"""Keyed tags, and optional encryption, of blocks stored at rest (G3 files, G4 objects):
who does not hold the deployment's secret cannot make a block that passes as ours, nor (with
``encrypt_at_rest``) read one.

A stored block's xxh3-64 checksum catches damage, but anyone who can write the file or the
bucket can recompute it for bytes of their choosing. Its *tag* is a keyed BLAKE3 hash,
truncated to 64 bits, of the block's identity (its tier's compatibility fingerprint and its
sequence hash: a genuine block moved under another name or model fails) and its payload. The
key is derived from the deployment's secret (:mod:`kvstrata.secret`) for this one purpose, so
a forger needs the secret; a guess passes once in 2^64.

**Encryption** (:class:`BlockCipher`, ``encrypt_at_rest = true``): AES-256-GCM with a key
derived from the secret for that purpose. Each block written gets a fresh random 16-byte
salt; its own AES key is a keyed BLAKE3 hash of the salt, so no key ever encrypts twice and
the nonce can be fixed (no limit on how many blocks a secret may encrypt). The additional
authenticated data is the block's identity and sequence hash, as for a tag, and GCM's
16-byte tag authenticates the ciphertext: an encrypted block needs no BLAKE3 tag. The salt
and the GCM tag (the block's *seal*, 32 bytes) are stored beside the block.

Where the tag is kept and checked: :mod:`~.storage.disk_index` and
:class:`~.storage.disk.DiskStorage` (one per index record, checked on every read from the
slab), :mod:`~.storage.object_format` (in the object's header, checked on every get). A
tier's files or objects written under another key, or none, are not read as its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..secret import derive_key, resolve_secret

__all__ = ["BlockTagger", "BlockCipher", "KeysAtRest", "keys_at_rest", "TAG_PURPOSE", "CIPHER_PURPOSE", "SEAL_BYTES", "NO_SEAL"]

TAG_PURPOSE = "kvstrata 2026-11-27 stored block tags v1"
"""The key derivation context of stored-block tags (a new one re-keys every stored block)."""
CIPHER_PURPOSE = "kvstrata 2026-11-27 stored block encryption v1"
SEAL_BYTES = 32
"""A block's seal: its 16-byte salt, then GCM's 16-byte tag."""
NO_SEAL = bytes(SEAL_BYTES)
_NONCE = bytes(12)                 # each AES key encrypts one block: a fixed nonce is safe


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


class BlockCipher:
    """Encrypts and decrypts stored blocks (see the module docstring)."""

    def __init__(self, key: bytes) -> None:
        import blake3
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        if not isinstance(key, bytes) or len(key) != 32:
            raise ValueError("a block encryption key is 32 bytes")
        self._blake3 = blake3.blake3
        self._key = key
        self._cipher = lambda block_key, tag=None: Cipher(algorithms.AES(block_key),
                                                          modes.GCM(_NONCE, tag))

    @classmethod
    def from_secret(cls, secret: bytes) -> "BlockCipher":
        return cls(derive_key(secret, CIPHER_PURPOSE))

    def _block_key(self, salt: bytes) -> bytes:
        return self._blake3(salt, key=self._key).digest(32)

    @staticmethod
    def _aad(identity: bytes, sequence_hash: int) -> bytes:
        return len(identity).to_bytes(4, "little") + identity + sequence_hash.to_bytes(8, "little")

    def encrypt(self, identity: bytes, sequence_hash: int, plain, out) -> bytes:
        """Encrypt ``plain`` into ``out`` (writable, the same length; may be ``plain``
        itself) as block ``sequence_hash`` under ``identity``; returns its seal."""
        import os

        salt = os.urandom(16)
        encryptor = self._cipher(self._block_key(salt)).encryptor()
        encryptor.authenticate_additional_data(self._aad(identity, sequence_hash))
        encryptor.update_into(memoryview(plain).cast("B"), memoryview(out).cast("B"))
        encryptor.finalize()
        return salt + encryptor.tag

    def decrypt(self, identity: bytes, sequence_hash: int, sealed, seal: bytes, out) -> bool:
        """Decrypt ``sealed`` into ``out`` (may be the same buffer); False if the block is
        not what was sealed under ``identity``, ``sequence_hash`` and this key (``out``
        then holds garbage and must not be used)."""
        from cryptography.exceptions import InvalidTag

        if len(seal) != SEAL_BYTES:
            return False
        decryptor = self._cipher(self._block_key(bytes(seal[:16])), bytes(seal[16:])).decryptor()
        decryptor.authenticate_additional_data(self._aad(identity, sequence_hash))
        decryptor.update_into(memoryview(sealed).cast("B"), memoryview(out).cast("B"))
        try:
            decryptor.finalize()
        except InvalidTag:
            return False
        return True


@dataclass(frozen=True)
class KeysAtRest:
    """What keys a tier's stored blocks: the tagger and the cipher of one secret."""

    tagger: BlockTagger
    cipher: BlockCipher


def keys_at_rest(secret: bytes | None = None,
                 env: Mapping[str, str] | None = None) -> KeysAtRest | None:
    """The tagger and cipher of the deployment's secret (``secret``, else the
    environment's, resolved once), or None when no secret is set
    (:class:`~kvstrata.secret.SecretError` when one is set but unusable)."""
    secret = resolve_secret(secret, env=env)
    if secret is None:
        return None
    return KeysAtRest(BlockTagger.from_secret(secret), BlockCipher.from_secret(secret))
