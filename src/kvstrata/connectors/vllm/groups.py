"""vLLM's KV cache groups, as the connector stores and loads them.

A hybrid model (sliding-window and full attention layers: Gemma 2/3, gpt-oss, Mistral-style
models) has several KV cache groups when vLLM's hybrid KV cache manager is on. Every group
draws its blocks from one pool and every block id names the same page in every KV tensor, so a
block of any group moves exactly as a block of a single-group model does; what differs is which
block id each group gives a position of the prompt, and which positions a group keeps:

* a **full-attention** group (MLA included) keeps every block of a request;
* a **sliding-window** group needs only the blocks inside its window: vLLM frees the others
  while the request runs and puts its null block in their place in the block table;
* a **Mamba / linear-attention** group (vLLM's "align" mode) holds a recurrent state, not KV:
  the block at position ``i`` holds the state after exactly ``(i + 1) * block_size`` tokens
  (vLLM cuts prefill chunks at block boundaries and writes a state only at a chunk's end), so
  a prefix of ``n`` blocks needs that group's block ``n - 1`` alone.

kvstrata names each group's block of a prompt position by one chain of hashes per request
(:mod:`kvstrata.tokens`): the *primary* group (the first full-attention group, else group 0)
uses the chain hash itself, so routers that match prompts by those hashes find it; any other
group uses the chain hash mixed with a constant of its own (:meth:`KvGroups.key`), so the
blocks of two groups never share a name in kvstrata's tiers. Events say which group a block is
in the way vLLM's own events do (``group_idx``, the spec's kind and window; see
:mod:`.events`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import xxhash

__all__ = ["KvGroup", "KvGroups", "FULL", "SLIDING", "MLA", "MAMBA", "group_of_spec"]

FULL = "full_attention"
SLIDING = "sliding_window"
MLA = "mla_attention"
MAMBA = "mamba"
"""vLLM's names of the kinds of KV cache spec this connector holds
(``vllm.v1.kv_cache_interface.get_kv_cache_spec_kind``)."""

_MASK = (1 << 64) - 1
_GROUP_TAG = xxhash.xxh3_64_intdigest(b"kvstrata kv cache group tag") & ~0xFFFF
"""The local hash of a block of a non-primary group is this tag with the group's index in its
low 16 bits: the group of a stored block can then be read from its record, in a durable
tier's index after a restart too (a tokens hash equal to it by chance: odds 2^-48)."""


@dataclass(frozen=True)
class KvGroup:
    """One of vLLM's KV cache groups: its index in ``kv_cache_groups``, its kind, and for a
    sliding-window group the window in tokens."""

    index: int
    kind: str
    sliding_window: int | None = None
    state: str = ""
    """For a Mamba group, what its state page holds (shapes and dtypes): a page is only
    valid for the same layout."""

    @property
    def keeps_every_block(self) -> bool:
        return self.kind in (FULL, MLA)

    def describe(self) -> str:
        if self.sliding_window:
            return f"{self.kind}({self.sliding_window})"
        return f"{self.kind}({self.state})" if self.state else self.kind


def group_of_spec(index: int, spec: Any) -> KvGroup:
    """The connector's view of vLLM's KV cache group ``index`` of spec ``spec``;
    ``ValueError`` naming the spec when the connector cannot hold it.

    Held: full attention (a ``FullAttentionSpec``, whose ``sliding_window`` vLLM sets when it
    merged sliding-window layers into full attention with its hybrid manager off: managed as
    full attention), MLA, sliding-window attention, and Mamba / linear-attention state in
    vLLM's "align" mode without speculative or checkpoint blocks (a block at a position holds
    the state at that position's end). Refused: chunked-local attention, Mamba in another
    mode, and anything else."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, MambaSpec, MLAAttentionSpec,
                                            SlidingWindowSpec)

    kind = type(spec).__name__
    if type(spec) is MLAAttentionSpec:
        return KvGroup(index, MLA)
    if type(spec) is FullAttentionSpec and not getattr(spec, "attention_chunk_size", None):
        return KvGroup(index, FULL)
    if type(spec) is SlidingWindowSpec:
        return KvGroup(index, SLIDING, int(spec.sliding_window))
    if type(spec) is MambaSpec:
        mode = getattr(spec, "mamba_cache_mode", "none")
        extra = (getattr(spec, "num_speculative_blocks", 0)
                 or getattr(spec, "num_prefill_checkpoint_blocks", 0))
        if mode == "align" and not extra:
            state = "+".join(f"{'x'.join(map(str, shape))}:{str(dtype).removeprefix('torch.')}"
                             for shape, dtype in zip(spec.shapes, spec.dtypes))
            return KvGroup(index, MAMBA, state=state)
        raise ValueError(
            f"group {index} is a Mamba state in vLLM's {mode!r} cache mode"
            f"{' with speculative or checkpoint blocks' if extra else ''}: the connector "
            f"holds Mamba states in 'align' mode only (prefix caching on, no speculative "
            f"decoding; docs/vllm.md, attention types)")
    raise ValueError(f"it holds full-attention, MLA, sliding-window and Mamba (align) KV "
                     f"cache groups; group {index} of this model is {kind} (docs/vllm.md, "
                     f"attention types)")


def _group_salt(index: int) -> int:
    return xxhash.xxh3_64_intdigest(f"kvstrata kv cache group {index}".encode())


@dataclass(frozen=True)
class KvGroups:
    """The groups of one engine's KV cache, and how their blocks are named."""

    groups: tuple[KvGroup, ...] = (KvGroup(0, FULL),)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV cache has at least one group")

    @property
    def primary(self) -> int:
        """Position (in :attr:`groups`) of the group named by the chain hashes themselves."""
        for pos, group in enumerate(self.groups):
            if group.keeps_every_block:
                return pos
        return 0

    @property
    def single(self) -> bool:
        return len(self.groups) == 1

    @property
    def has_window(self) -> bool:
        return any(not g.keeps_every_block for g in self.groups)

    def signature(self) -> str:
        """The groups in one line (part of the fingerprint of stored blocks: blocks stored
        under another grouping are never read)."""
        return ",".join(g.describe() for g in self.groups)

    def key(self, pos: int, sequence_hash: int) -> int:
        """kvstrata's name of group ``pos``'s block at a position whose chain hash is
        ``sequence_hash``."""
        if pos == self.primary:
            return sequence_hash
        return (sequence_hash ^ _group_salt(self.groups[pos].index)) & _MASK

    def local_hash(self, pos: int, tokens_hash: int) -> int:
        """The ``local_hash`` of group ``pos``'s block whose tokens hash to ``tokens_hash``:
        that hash for the primary group, a tag naming the group otherwise."""
        return tokens_hash if pos == self.primary else _GROUP_TAG | self.groups[pos].index

    def position_of(self, local_hash: int) -> int:
        """The group (its position) of a block whose record has ``local_hash``."""
        if local_hash & ~0xFFFF == _GROUP_TAG:
            index = local_hash & 0xFFFF
            for pos, group in enumerate(self.groups):
                if group.index == index:
                    return pos
        return self.primary

    def chain_hash(self, pos: int, key: int) -> int:
        """The chain hash a :meth:`key` of group ``pos`` was made from."""
        return key if pos == self.primary else (key ^ _group_salt(self.groups[pos].index)) & _MASK

    def first_needed(self, pos: int, end: int, block_size: int,
                     skipped: Callable[[int, int], int] | None = None) -> int:
        """The first block a request whose first ``end`` tokens are computed needs in group
        ``pos`` (0 for a full-attention group). ``skipped(group_index, tokens)``, when given,
        is vLLM's own count of tokens a group no longer attends to (its KV cache manager:
        exact, speculative decoding's retained tokens included); otherwise a window of ``w``
        tokens skips ``end - w + 1`` tokens, and a Mamba group all but the last."""
        group = self.groups[pos]
        if group.keeps_every_block:
            return 0
        if skipped is not None:
            tokens = skipped(group.index, end)
        elif group.kind == MAMBA:
            tokens = end - 1                  # the state after the last token only
        else:
            tokens = end - group.sliding_window + 1
        return max(0, tokens) // block_size

    def longest_hit(self, chain: Sequence[int], start: int,
                    held: Callable[[int], bool], block_size: int,
                    skipped: Callable[[int, int], int] | None = None) -> int:
        """The most blocks ``n`` of ``chain[start:]`` (chain hashes by position) that every
        group can serve when the first ``start`` blocks are computed already: full-attention
        groups hold every block of ``[start, start + n)``, sliding-window groups every block
        of their window ending there (:meth:`needed`). ``held(key)`` says whether a block
        is held."""
        full = [p for p, g in enumerate(self.groups) if g.keeps_every_block]
        windowed = [p for p, g in enumerate(self.groups) if not g.keeps_every_block]
        end = start
        while end < len(chain) and all(held(self.key(p, chain[end])) for p in full):
            end += 1
        if not windowed:
            return end - start
        runs = {}                   # runs[p][i]: blocks held in a row in group p up to start+i
        for p in windowed:
            run, count = [], 0
            for i in range(start, end):
                count = count + 1 if held(self.key(p, chain[i])) else 0
                run.append(count)
            runs[p] = run
        for n in range(end, start, -1):
            if all(runs[p][n - 1 - start] >= n - max(start, self.first_needed(
                    p, n * block_size, block_size, skipped)) for p in windowed):
                return n - start
        return 0

    def needed(self, start: int, stop: int, block_size: int,
               skipped: Callable[[int, int], int] | None = None) -> list[tuple[int, int]]:
        """``(group position, block)`` of every block to load for blocks ``[start, stop)``
        of a request whose first ``start`` blocks are computed: all of them in a
        full-attention group, those of the window ending at ``stop`` in a sliding-window
        group."""
        out = []
        for p in range(len(self.groups)):
            first = max(start, self.first_needed(p, stop * block_size, block_size, skipped))
            out.extend((p, i) for i in range(first, stop))
        return out

    def tiers(self, chain: Sequence[int], start: int, tier_of: Callable[[int], Any],
              block_size: int, skipped: Callable[[int, int], int] | None = None) -> list:
        """Per block of :meth:`longest_hit` (``tier_of(key)``: the tier holding a block, or
        None), the tier it is counted from: a full-attention group's block there, else the
        nearest block of a window loaded after it."""
        n = self.longest_hit(chain, start, lambda key: tier_of(key) is not None, block_size,
                             skipped)
        at: dict[int, Any] = {}
        for pos, i in self.needed(start, start + n, block_size, skipped):
            if i not in at or self.groups[pos].keeps_every_block:
                at[i] = tier_of(self.key(pos, chain[i]))
        tiers: list = []
        nearest = None
        for i in range(start + n - 1, start - 1, -1):
            nearest = at.get(i) or nearest
            tiers.append(nearest)
        tiers.reverse()
        return tiers

    def targets(self, chain: Sequence[int], block_ids: Sequence[Sequence[int]], start: int,
                stop: int, null_block: int = 0) -> list[tuple[int, int]]:
        """(block name, engine block id) of every block to load for blocks ``[start, stop)``
        of a request: each group's block that vLLM allocated there (``block_ids``, one list
        per group); not its null block, which a sliding-window group gets outside its
        window."""
        out = []
        for pos, ids in enumerate(block_ids[:len(self.groups)]):
            out.extend((self.key(pos, chain[i]), ids[i])
                       for i in range(start, min(stop, len(ids))) if ids[i] != null_block)
        return out
