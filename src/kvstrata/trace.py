"""Mooncake-format traces: parsing, and the block records an engine would compute for them.

Trace format: one JSON object per line with ``timestamp`` (ms), ``input_length``,
``output_length`` (tokens) and ``hash_ids`` (one id per 512-token block; requests that share
leading ids share that prefix). Blank lines are skipped; a malformed line raises
:class:`TraceFormatError` naming the file and line.

**Synthetic tokens.** Each trace id ``h`` stands for 512 tokens; token ``j`` (0..511) of id
``h`` is ``(h * 512 + j) mod 2**32``. A request's tokens are the concatenation of its ids'
tokens, hashed with :mod:`kvstrata.tokens` exactly as an engine's prompt would be, so a replay
exercises the same hashing and matching path as real traffic.

**Granularity.** ``trace``: one block per id (block size 512); every id is a block, including
the request's last, partially filled one, whose token count is what ``input_length`` leaves.
``engine``: blocks of ``block_size`` tokens (e.g. 16, 32 per id); only the prompt's full
blocks count (``min(input_length, 512 * ids) // block_size``), as an engine would hash them.
"""

from __future__ import annotations

import codecs
from array import array
import contextlib
import gzip
import json
import math
import os
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO, Iterator, Sequence

import numpy as np

from .paths import MAX_LINE_BYTES, InputTooLargeError, bounded_lines, open_regular
from .tokens import DEFAULT_SEED, hash_blocks
from .types import BlockRecord

__all__ = ["TRACE_BLOCK_TOKENS", "TraceFormatError", "TraceRequest", "default_trace_path",
           "parse_request", "iter_trace", "load_trace", "synthetic_tokens", "RequestHasher"]

TRACE_BLOCK_TOKENS = 512
"""Tokens behind one Mooncake trace id."""


class TraceFormatError(ValueError):
    """A malformed trace line; the message names the file and line."""


@dataclass(frozen=True, slots=True, eq=False)
class TraceRequest:
    """One line of a trace. ``hash_ids`` as :func:`parse_request` makes them are an
    ``array('I')`` (4 bytes an id, where a tuple of ints takes about 36: a trace is held whole
    while it is replayed); any sequence of ints will do."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: Sequence[int]


def default_trace_path() -> Path:
    """The Mooncake conversation trace shipped inside the package."""
    return Path(str(resources.files("kvstrata") / "data" / "conversation_trace.jsonl.gz"))


@contextlib.contextmanager
def _open_lines(path: Path) -> Iterator[IO[bytes]]:
    """A regular file's bytes (``.gz`` decompressed as they are read), split into lines on
    ``\n`` only and decoded one line at a time by the reader (a decoding error then names
    its line, and a carriage return inside a JSON line is the whitespace JSON says it is); a
    FIFO or a device is refused (:func:`kvstrata.paths.open_regular`). Everything opened is
    closed after."""
    with open_regular(path) as raw:
        if path.suffix == ".gz":
            with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                yield unzipped
        else:
            yield raw


MAX_TRACE_NUMBER = 2**63
"""Largest timestamp or length a trace line may give (a bigger one is a malformed line)."""
MAX_REQUEST_BLOCKS = 1 << 15
"""Most ``hash_ids`` one request may name: 16.7 M tokens of 512-token blocks, beyond any
model's context. A replay at engine granularity expands each into ``512 / block_size``
blocks, so a line of more (a 1 MiB line holds 500 K) could need gigabytes."""
MAX_PROMPT_BLOCKS = 1 << 20
"""Most blocks one request may expand into at engine granularity (:func:`prompt_blocks`):
a million blocks of records take about 200 MB; 32,768 ids of 512 tokens in blocks of one
token would take gigabytes."""


def parse_request(line: str, where: str) -> TraceRequest:
    """One trace line -> :class:`TraceRequest`; ``where`` ("file:line") names it in errors."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise TraceFormatError(f"{where}: nests too deeply") from None
    except ValueError as exc:                    # e.g. an integer of thousands of digits
        if "int_max_str_digits" in str(exc):
            raise TraceFormatError(f"{where}: holds a number of more than "
                                   f"{sys.get_int_max_str_digits():,} digits") from None
        raise TraceFormatError(f"{where}: {' '.join(str(exc).split())[:120]}") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("input_length", "hash_ids") if k not in obj]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    ids = obj["hash_ids"]
    if isinstance(ids, list) and len(ids) > MAX_REQUEST_BLOCKS:
        raise TraceFormatError(f"{where}: {len(ids):,} hash_ids: a request names at most "
                               f"{MAX_REQUEST_BLOCKS:,} ({MAX_REQUEST_BLOCKS * TRACE_BLOCK_TOKENS:,}"
                               f" tokens)")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**32 // TRACE_BLOCK_TOKENS
        for i in ids
    ):
        raise TraceFormatError(
            f"{where}: hash_ids must be a list of integers in [0, {2**32 // TRACE_BLOCK_TOKENS})"
        )
    fields = {}
    for key in ("timestamp", "input_length", "output_length"):
        value = obj.get(key, 0)
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
            or value < 0
            or value > MAX_TRACE_NUMBER
        ):
            raise TraceFormatError(f"{where}: {key} must be a number in 0..2**63, got "
                                   f"{value!r:.40}")
        if key != "timestamp" and value != int(value):
            raise TraceFormatError(f"{where}: {key} counts tokens: a whole number, got {value!r}")
        fields[key] = int(value)
    return TraceRequest(fields["timestamp"], fields["input_length"], fields["output_length"],
                        array("I", ids))


def prompt_blocks(request: TraceRequest, block_size: int) -> int:
    """How many blocks of ``block_size`` tokens an engine computes for ``request``'s prompt
    (the whole blocks of its tokens that its ``hash_ids`` cover)."""
    return min(request.input_length, len(request.hash_ids) * TRACE_BLOCK_TOKENS) // block_size


def expansion_problem(requests: Sequence[TraceRequest], block_size: int) -> str | None:
    """Why ``requests`` cannot be replayed at engine granularity with ``block_size``-token
    blocks (a request of more than :data:`MAX_PROMPT_BLOCKS` blocks); None if they can."""
    for number, request in enumerate(requests, start=1):
        blocks = prompt_blocks(request, block_size)
        if blocks > MAX_PROMPT_BLOCKS:
            return (f"request {number} is {blocks:,} blocks of {block_size} tokens, over "
                    f"{MAX_PROMPT_BLOCKS:,}: use larger blocks (--block-size)")
    return None


def iter_trace(path: str | os.PathLike[str] | None = None) -> Iterator[TraceRequest]:
    """Requests of a trace file (plain or .gz); the packaged trace when ``path`` is None."""
    path = Path(path) if path is not None else default_trace_path()
    with _open_lines(path) as fh:
        try:
            for number, raw in enumerate(bounded_lines(fh, MAX_LINE_BYTES), start=1):
                if number == 1 and raw.startswith(codecs.BOM_UTF8):
                    raw = raw[len(codecs.BOM_UTF8):]      # a BOM some editors write
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise TraceFormatError(f"{path}:{number}: not UTF-8 text") from None
                if line.strip():
                    yield parse_request(line, f"{path}:{number}")
        except InputTooLargeError as exc:
            raise TraceFormatError(f"{path}: {exc}") from None


def load_trace(path: str | os.PathLike[str] | None = None) -> list[TraceRequest]:
    """All requests of a trace (see :func:`iter_trace`)."""
    return list(iter_trace(path))


# -- hashing a request -----------------------------------------------------------------------

def synthetic_tokens(hash_id: int) -> np.ndarray:
    """The 512 deterministic token ids standing for trace id ``hash_id``."""
    base = hash_id * TRACE_BLOCK_TOKENS
    return (np.arange(base, base + TRACE_BLOCK_TOKENS, dtype=np.uint64) & 0xFFFFFFFF).astype("<u4")


MEMO_RECORDS = 1 << 19
"""Most block records a :class:`RequestHasher` keeps for reuse (about 90 MB): past that it
starts again, so its memory follows this bound, not the number of distinct blocks of a
trace."""


class RequestHasher:
    """Turns a trace request into the block records an engine would compute for its prompt.

    Hashes of one id's blocks depend only on (parent hash, id), so they are memoised on that
    pair when the block size divides 512 (always the case for engine block sizes 16..512).
    """

    def __init__(self, block_size: int, granularity: str, seed: int = DEFAULT_SEED) -> None:
        if granularity not in ("trace", "engine"):
            raise ValueError(f"granularity must be 'trace' or 'engine', got {granularity!r}")
        if granularity == "trace":
            block_size = TRACE_BLOCK_TOKENS
        self.block_size = block_size
        self.granularity = granularity
        self.seed = seed
        self._memo: dict[tuple[int | None, int], list[BlockRecord]] = {}
        self._memo_records = 0
        self._aligned = TRACE_BLOCK_TOKENS % block_size == 0

    def records(self, request: TraceRequest) -> tuple[list[BlockRecord], list[int]]:
        """The request's block records and the prompt tokens each block covers."""
        ids = request.hash_ids
        bs = self.block_size
        if self.granularity == "trace":
            n_blocks = len(ids)
        else:
            n_blocks = prompt_blocks(request, bs)
            if n_blocks > MAX_PROMPT_BLOCKS:
                raise TraceFormatError(expansion_problem([request], bs))
        if self._aligned:
            records = self._aligned_records(ids, n_blocks)
        else:
            tokens = np.concatenate([synthetic_tokens(h) for h in ids]) if ids else np.zeros(0, "<u4")
            local, seqs = hash_blocks(tokens[: n_blocks * bs], bs, self.seed)
            parents = [None, *seqs[:-1]]
            records = [BlockRecord(s, l, p, bs) for s, l, p in zip(seqs, local, parents)]
        if self.granularity == "trace":
            # each id stands for up to 512 of the prompt's tokens, in order: a prompt shorter
            # than its ids say (a trace of smaller blocks, a broken line) counts only the
            # tokens it has, never more than input_length in all
            left = request.input_length
            token_counts = []
            for _ in records:
                token_counts.append(max(0, min(TRACE_BLOCK_TOKENS, left)))
                left -= TRACE_BLOCK_TOKENS
        else:
            token_counts = [bs] * len(records)
        return records, token_counts

    def _aligned_records(self, ids: Sequence[int], n_blocks: int) -> list[BlockRecord]:
        per_id = TRACE_BLOCK_TOKENS // self.block_size
        out: list[BlockRecord] = []
        parent: int | None = None
        memo = self._memo
        for h in ids:
            if len(out) >= n_blocks:
                break
            key = (parent, h)
            recs = memo.get(key)
            if recs is None:
                local, seqs = hash_blocks(synthetic_tokens(h), self.block_size, self.seed, parent)
                parents = [parent, *seqs[:-1]]
                recs = [BlockRecord(s, l, p, self.block_size) for s, l, p in zip(seqs, local, parents)]
                if self._memo_records >= MEMO_RECORDS:     # bounded: made again if needed
                    memo.clear()
                    self._memo_records = 0
                memo[key] = recs
                self._memo_records += len(recs)
            out.extend(recs[: n_blocks - len(out)] if len(out) + per_id > n_blocks else recs)
            parent = out[-1].sequence_hash
        return out
