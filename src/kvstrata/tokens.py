"""Token blocks and chained block hashes, compatible with the Dynamo KV router.

The scheme, the Dynamo KV router's, fixed so that every process, run and machine agrees:

* tokens are hashed per *full* block of ``block_size`` tokens; a partial tail has no hash;
* local block hash = ``xxh3_64(tokens as little-endian uint32, seed)``;
* sequence hash of block 0 = its local hash; of block i > 0 =
  ``xxh3_64(pack('<QQ', seq_hash[i-1], local_hash[i]), seed)``.

The seed is 1337 unless the tokens belong to a LoRA adapter or carry a per-request cache salt
(see :func:`isolation_seed`). Different seeds give unrelated chains (equal hashes would need a
64-bit collision), so two tenants do not share blocks.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from typing import Iterable, Sequence

import numpy as np
import xxhash

DEFAULT_SEED = 1337
_MASK64 = (1 << 64) - 1
_pack_pair = struct.Struct("<QQ").pack
_xxh3 = xxhash.xxh3_64_intdigest

_NATIVE_FUNCTIONS = ("hash_blocks", "chain_hashes")


def _load_native():
    """The optional native fast path (src/kvstrata/_tokenhash.c, built by `pip install -e .`),
    or None: no compiler at install time, or a stale build (then the pure-Python path below
    runs, with the same hashes)."""
    try:
        from . import _tokenhash
    except ImportError:
        return None
    if not all(hasattr(_tokenhash, n) for n in (*_NATIVE_FUNCTIONS, "bind")):
        return None
    try:
        _tokenhash.bind(xxhash_function_address())
        probe = _tokenhash.hash_blocks([1, 2, 3, 4], 4, DEFAULT_SEED, None)
    except Exception:       # no such symbol, another ABI: the Python path runs
        return None
    expected = _xxh3(struct.pack("<4I", 1, 2, 3, 4), seed=DEFAULT_SEED)
    return _tokenhash if probe is not None and probe[0] == [expected] else None


def xxhash_function_address(name: str = "XXH3_64bits_withSeed") -> int:
    """Address of the C function ``name`` of the xxhash library in the pinned ``xxhash``
    package's own extension (it exports the library's functions): kvstrata's native paths
    call these, so no xxh3 code is compiled into kvstrata."""
    import ctypes

    import xxhash._xxhash as module

    function = getattr(ctypes.CDLL(module.__file__), name)
    return ctypes.cast(function, ctypes.c_void_p).value


_native = _load_native()

NATIVE = _native is not None
"""Whether the native hashing path is available (tests run both paths; see use_native)."""


def use_native(enabled: bool) -> bool:
    """Turn the native hashing path on or off (tests and benchmarks); returns the previous
    setting. Turning it on without the extension built raises ``RuntimeError``."""
    global _native
    previous = _native is not None
    if enabled:
        native = _load_native()
        if native is None:
            raise RuntimeError("the native hashing extension (kvstrata._tokenhash) is not built")
        _native = native
    else:
        _native = None
    return previous


class TokenError(ValueError):
    """Token ids or block parameters that cannot be hashed (negative, > 2**32-1, bad size)."""


def isolation_seed(lora_name: str | None = None, cache_salt: str | bytes | None = None,
                   lora_path: str | None = None) -> int:
    """The hash seed for a tenant.

    * no LoRA, no salt: 1337 (the Dynamo default);
    * LoRA adapter: ``(1337 + xxh3_64(lora_name utf-8)) mod 2**64`` (Dynamo's rule), then,
      where the adapter's path is known (vLLM's ``lora_path``), ``xxh3_64(b"lora_path:" +
      path, seed=s)``: a name pointed at another adapter is another tenant's KV (vLLM keys
      its own prefix cache by name and path for this reason). A router hashing by the name
      alone (Dynamo's rule) then finds no LoRA request's blocks;
    * cache salt (vLLM's per-request ``cache_salt``): ``xxh3_64(b"salt:" + salt, seed=s)``
      where ``s`` is the seed so far (1337 or the LoRA seed). The salt goes through a
      different function than the LoRA name, so a salt and a LoRA name cannot produce the
      same seed except by a 64-bit hash collision.
    """
    seed = DEFAULT_SEED
    if lora_name:
        seed = (seed + _xxh3(lora_name.encode("utf-8"))) & _MASK64
        if lora_path:
            seed = _xxh3(b"lora_path:" + lora_path.encode("utf-8", "surrogatepass"), seed=seed)
    if cache_salt:
        salt = cache_salt.encode("utf-8") if isinstance(cache_salt, str) else bytes(cache_salt)
        seed = _xxh3(b"salt:" + salt, seed=seed)
    return seed


def tenant_key(lora_name: str | None = None, cache_salt: str | bytes | None = None) -> str:
    """Whose blocks a request's are, for tenant quotas (:mod:`kvstrata.placement.tenants`):
    ``"salt:" + cache_salt`` if it has a salt (the salt names the tenant, whatever adapter
    the request uses), else ``"lora:" + lora_name``, else ``""`` (the default tenant). The
    prefixes keep salts and adapter names apart, as :func:`isolation_seed` does: no salt
    takes an adapter's quota. A salt over 200 characters (or given as bytes) is named
    ``"salt#"`` and the first 32 hex digits of its SHA-256, an adapter name over 195
    ``"lora#"`` and the same, so a key stays short."""
    if cache_salt:
        if isinstance(cache_salt, str) and len(cache_salt) <= 200:
            return "salt:" + cache_salt
        raw = cache_salt.encode("utf-8", "surrogatepass") if isinstance(cache_salt, str) \
            else bytes(cache_salt)
        return "salt#" + hashlib.sha256(raw).hexdigest()[:32]
    if lora_name:
        if len(lora_name) <= 195:
            return "lora:" + lora_name
        return "lora#" + hashlib.sha256(lora_name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return ""


def _as_uint32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array, validated."""
    if isinstance(tokens, np.ndarray):
        if tokens.dtype == np.dtype("<u4"):
            return np.ascontiguousarray(tokens)
        if tokens.dtype.kind not in "iu":
            raise TokenError(f"token ids must be integers, got dtype {tokens.dtype}")
        if tokens.size and (tokens.min() < 0 or tokens.max() > 0xFFFFFFFF):
            raise TokenError("token ids must be in [0, 2**32-1]")
        return np.ascontiguousarray(tokens, dtype="<u4")
    return np.frombuffer(_list_to_le_bytes(tokens), dtype="<u4")


_UINT32_CODE = "I" if array("I").itemsize == 4 else "L"


def _list_to_le_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian uint32 bytes of a list of ints (array.array is ~3x faster than numpy here)."""
    try:
        packed = array(_UINT32_CODE, tokens)
    except (OverflowError, TypeError) as exc:
        raise TokenError(f"token ids must be integers in [0, 2**32-1]: {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    if isinstance(tokens, np.ndarray):
        return _as_uint32(tokens).tobytes()
    return _list_to_le_bytes(tokens)


MAX_BLOCK_SIZE = 1 << 16
"""Most tokens a block holds (engines use 16 to 256; a trace's own granularity is 512)."""


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) \
            or not 0 < block_size <= MAX_BLOCK_SIZE:
        raise TokenError(f"block_size must be an int in 1..{MAX_BLOCK_SIZE:,}, got "
                         f"{block_size!r:.40}")


def local_block_hash(tokens: Sequence[int] | np.ndarray, seed: int = DEFAULT_SEED) -> int:
    """Hash of one block's tokens, independent of what came before."""
    return _xxh3(_as_uint32(tokens), seed=seed)


def chain_hash(parent_sequence_hash: int | None, local_hash: int, seed: int = DEFAULT_SEED) -> int:
    """Sequence hash of a block from its parent's sequence hash and its own local hash."""
    if parent_sequence_hash is None:
        return local_hash
    return _xxh3(_pack_pair(parent_sequence_hash, local_hash), seed=seed)


def hash_blocks(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    seed: int = DEFAULT_SEED,
    parent_sequence_hash: int | None = None,
) -> tuple[list[int], list[int]]:
    """Local and sequence hashes of every full block of ``tokens``.

    ``parent_sequence_hash`` continues an existing chain (the hash of the block before
    ``tokens[0]``). Returns ``(local_hashes, sequence_hashes)``.
    """
    _check_block_size(block_size)
    native = _native
    if native is not None:
        # Lists and uint32 buffers in C; anything it does not take (a tuple, a bool or
        # numpy scalar in a list, an id out of range...) returns None and goes the Python way,
        # which converts or raises exactly as without the extension.
        if isinstance(tokens, np.ndarray):
            tokens = _as_uint32(tokens)
        out = native.hash_blocks(tokens, block_size, seed, parent_sequence_hash)
        if out is not None:
            return out
    data = _token_bytes(tokens)
    step = block_size * 4
    end = len(data) // step * step
    local_hashes = [_xxh3(data[i : i + step], seed) for i in range(0, end, step)]
    sequence_hashes = chain_hashes(local_hashes, seed, parent_sequence_hash)
    return local_hashes, sequence_hashes


def chain_hashes(
    local_hashes: Iterable[int], seed: int = DEFAULT_SEED, parent_sequence_hash: int | None = None
) -> list[int]:
    """Sequence hashes for a run of local hashes continuing ``parent_sequence_hash``."""
    native = _native
    if native is not None and type(local_hashes) is list:
        chained = native.chain_hashes(local_hashes, seed, parent_sequence_hash)
        if chained is not None:
            return chained
    out: list[int] = []
    locals_ = iter(local_hashes)
    parent = parent_sequence_hash
    if parent is None:
        parent = next(locals_, None)
        if parent is None:
            return out
        out.append(parent)
    append = out.append
    for local in locals_:
        parent = _xxh3(_pack_pair(parent, local), seed)
        append(parent)
    return out


class TokenSequence:
    """A growing token sequence that hashes each block as soon as it is full.

    Appending a token is O(1); hashing happens once per completed block. ``extend`` takes a
    list or numpy array and hashes the completed blocks in one pass.

    >>> seq = TokenSequence(block_size=4)
    >>> seq.extend(range(1, 11))
    >>> seq.sequence_hashes
    [14643705804678351452, 4945711292740353085]
    """

    __slots__ = ("block_size", "seed", "_tail", "_n_tokens", "local_hashes", "sequence_hashes")

    def __init__(
        self,
        tokens: Sequence[int] | np.ndarray = (),
        *,
        block_size: int,
        seed: int = DEFAULT_SEED,
    ) -> None:
        _check_block_size(block_size)
        self.block_size = block_size
        self.seed = seed
        self._tail: list[int] = []
        self._n_tokens = 0
        self.local_hashes: list[int] = []
        self.sequence_hashes: list[int] = []
        if len(tokens):
            self.extend(tokens)

    def __len__(self) -> int:
        return self._n_tokens

    @property
    def num_full_blocks(self) -> int:
        return len(self.sequence_hashes)

    @property
    def tail_tokens(self) -> list[int]:
        """Tokens of the partial last block (not hashed yet)."""
        return list(self._tail)

    def append(self, token: int) -> int | None:
        """Add one token; returns the new block's sequence hash if it completed a block."""
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not (
            0 <= token <= 0xFFFFFFFF
        ):
            raise TokenError(f"token id must be an int in [0, 2**32-1], got {token!r}")
        self._tail.append(int(token))
        self._n_tokens += 1
        if len(self._tail) < self.block_size:
            return None
        return self._seal_tail()

    def extend(self, tokens: Sequence[int] | np.ndarray) -> list[int]:
        """Add many tokens; returns the sequence hashes of the blocks they completed."""
        ids = _as_uint32(tokens)
        if not len(ids):
            return []
        start = 0
        new_hashes: list[int] = []
        if self._tail:
            need = self.block_size - len(self._tail)
            self._tail.extend(ids[:need].tolist())
            self._n_tokens += min(need, len(ids))
            start = need
            if len(self._tail) == self.block_size:
                new_hashes.append(self._seal_tail())
        rest = ids[start:]
        if len(rest):
            parent = self.sequence_hashes[-1] if self.sequence_hashes else None
            local, seqs = hash_blocks(rest, self.block_size, self.seed, parent)
            self.local_hashes.extend(local)
            self.sequence_hashes.extend(seqs)
            new_hashes.extend(seqs)
            full = len(local) * self.block_size
            self._tail = rest[full:].tolist()
            self._n_tokens += len(rest)
        return new_hashes

    def pop(self) -> int:
        """Remove the last token (only from the partial tail; hashed blocks are immutable)."""
        if not self._tail:
            raise TokenError("no partial-block token to pop (full blocks are sealed)")
        self._n_tokens -= 1
        return self._tail.pop()

    def _seal_tail(self) -> int:
        local = _xxh3(np.asarray(self._tail, dtype="<u4"), seed=self.seed)
        parent = self.sequence_hashes[-1] if self.sequence_hashes else None
        seq = chain_hash(parent, local, self.seed)
        self.local_hashes.append(local)
        self.sequence_hashes.append(seq)
        self._tail = []
        return seq
