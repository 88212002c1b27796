"""Which stored KV blocks a process may use: the compatibility fingerprint.

A block stored in a tier that outlives its writer (a disk tier kept across restarts, an object
store shared by workers) may only be served to an engine that would have computed the same
bytes for the same sequence hash. That holds when everything below is equal, and the
fingerprint is a short digest of exactly that:

* the model's identity (``model_id``: a name and revision, e.g. what vLLM serves, which the
  vLLM connector follows with a digest of the resolved config and of the weights' content,
  :func:`weights_identity`); two models of the same geometry (two fine-tunes of one base)
  differ only here;
* the geometry of this rank's share of a block: layers, K/V (or MLA), tokens per block,
  elements per token, dtype;
* the shard: this rank and the number of ranks the KV heads are split over (tensor
  parallelism gives each rank different heads of the same geometry);
* the byte order of a stored block (``block_layout``): kvstrata's own (layer, K/V, tokens x
  elements) unless an engine's pages are stored as they are (the vLLM connector names its
  platform and attention backend there), and kvstrata's layout version and block hashing
  scheme (seed and chaining rule).

Per-tenant isolation is not part of it: LoRA adapters and cache salts already change every
sequence hash (:func:`kvstrata.tokens.isolation_seed`); a shared store adds the tenant's salt
to its keys on top.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import xxhash

from .dtypes import canonical_dtype
from .tokens import DEFAULT_SEED

__all__ = ["BLOCK_LAYOUT_VERSION", "HASH_SCHEME", "NATIVE_BLOCK_LAYOUT", "Compatibility",
           "compatibility_of", "weights_identity"]

BLOCK_LAYOUT_VERSION = 1
"""Version of the byte layout of one stored block: FullyContiguous, layer-major, then K/V,
then ``block_size x elements-per-token`` (see docs/physical.md). Bump it when that changes."""

HASH_SCHEME = f"xxh3-64 chain seed {DEFAULT_SEED}"

NATIVE_BLOCK_LAYOUT = "layer/kv/token"
"""``block_layout`` of blocks kvstrata lays out itself (``KvBlockManager``)."""
"""The block hashing rule (:mod:`kvstrata.tokens`); stored blocks are named by its hashes."""


@dataclass(frozen=True)
class Compatibility:
    """Everything that makes stored blocks usable here; :attr:`fingerprint` digests it."""

    model_id: str
    num_layers: int
    outer_dim: int
    block_size: int
    inner_dim: int
    dtype: str
    rank: int = 0
    world_size: int = 1
    block_layout: str = NATIVE_BLOCK_LAYOUT
    layout_version: int = BLOCK_LAYOUT_VERSION
    hash_scheme: str = HASH_SCHEME

    @property
    def fingerprint(self) -> str:
        """16 hex digits: the xxh3-64 of the canonical JSON of every field."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return f"{xxhash.xxh3_64_intdigest(text.encode()):016x}"

    def describe(self) -> str:
        """One line for logs: what the fingerprint stands for."""
        model = self.model_id or "(unnamed model)"
        return (f"{model}, {self.num_layers} layers x {self.outer_dim} x {self.block_size} "
                f"tokens x {self.inner_dim} {self.dtype}, rank {self.rank}/{self.world_size}, "
                f"{self.block_layout} v{self.layout_version}")


def compatibility_of(config, *, rank: int = 0, world_size: int = 1,
                     block_layout: str = NATIVE_BLOCK_LAYOUT) -> Compatibility:
    """The :class:`Compatibility` of a :class:`~kvstrata.config.KvConfig` (its ``model_id``
    and ``model`` geometry) for one rank of ``world_size``, blocks laid out as
    ``block_layout``."""
    m = config.model
    return Compatibility(model_id=config.model_id, num_layers=m.num_layers,
                         outer_dim=m.outer_dim, block_size=config.block_size,
                         inner_dim=m.kv_heads * m.head_dim, dtype=canonical_dtype(m.dtype),
                         rank=rank, world_size=world_size, block_layout=block_layout)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Files whose bytes are a model's weights (in its directory, not below it). Where there are
``.safetensors`` files only they count, as vLLM then loads only them (a stray
``pytorch_model.bin`` in one machine's copy does not make it another model)."""

WEIGHT_SAMPLES = 64
WEIGHT_SAMPLE_BYTES = 16 << 10
"""Each weights file is identified by its name, its size and the xxh3-64 of this many pieces
of this size spread evenly over it (the whole file when it is no bigger): 1 MiB read from
each weights file at start, in each process that names stored pages."""


def weights_identity(directory: str) -> str:
    """16 hex digits naming the weights in ``directory`` by their content (not by their
    path or times: the same weights copied to another machine give the same value), or ``""``
    if it holds no weights file. Two models of the same architecture and size (another
    fine-tune, new weights put at the same path) differ in their sampled pieces; a change
    that keeps every file's size and every sampled piece is not seen."""
    import os

    digest = xxhash.xxh3_64()
    found = False
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return ""
    weights = [n for n in names if n.endswith(".safetensors")] \
        or [n for n in names if n.endswith(WEIGHT_SUFFIXES)]
    for name in weights:
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                digest.update(f"{name}\0{size}\0".encode())
                if size <= WEIGHT_SAMPLES * WEIGHT_SAMPLE_BYTES:
                    digest.update(fh.read())
                else:
                    last = size - WEIGHT_SAMPLE_BYTES        # the file's first and last
                    for i in range(WEIGHT_SAMPLES):         # bytes are always read
                        fh.seek(last * i // (WEIGHT_SAMPLES - 1))
                        digest.update(fh.read(WEIGHT_SAMPLE_BYTES))
        except OSError:
            continue
        found = True
    return f"{digest.intdigest():016x}" if found else ""
