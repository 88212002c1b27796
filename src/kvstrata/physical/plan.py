"""Transfer plans and results: plain, validated, serializable records.

A :class:`TransferPlan` says *which* blocks move on *which* path; a scheduler builds it from
pool block ids (the logical layer) and may ship it to a worker process as ``plan.to_dict()``
(plain JSON types). The worker's engine answers with a :class:`TransferResult`, also
serializable, that says per block whether the copy succeeded, so the owner registers exactly
the good blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .errors import BlockFailure, TransferPlanError

__all__ = ["PATHS", "TIERS", "TransferPlan", "TransferResult"]

TIERS = ("G1", "G2", "G3")
PATHS = ("G1->G2", "G2->G3", "G2->G1", "G3->G1", "G3->G2")
_U64 = 1 << 64
_PLAN_KEYS = {"path", "src_block_ids", "dst_block_ids", "sequence_hashes", "plan_id"}


_INT_ONLY = {int}


def _int_tuple(name: str, values: Any, upper: int | None = None) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TransferPlanError(f"{name} must be a list of ints, got {type(values).__name__}")
    out = tuple(values)
    # Fast path (C loops, ~50 ns per element): all plain ints (no bools) within range.
    if out and set(map(type, out)) <= _INT_ONLY and min(out) >= 0 \
            and (upper is None or max(out) < upper):
        return out
    return _int_tuple_checked(name, out, upper)


def _int_tuple_checked(name: str, values: tuple, upper: int | None) -> tuple[int, ...]:
    """Element-by-element validation that names the first bad element."""
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TransferPlanError(f"{name}[{i}] must be an int, got {v!r}")
        if v < 0 or (upper is not None and v >= upper):
            raise TransferPlanError(f"{name}[{i}] = {v} is out of range")
        out.append(v)
    return tuple(out)


@dataclass(frozen=True)
class TransferPlan:
    """Copy block ``src_block_ids[i]`` of the source tier to ``dst_block_ids[i]`` of the
    destination tier; ``sequence_hashes[i]`` names the block (stored with it, checked on
    reads, reported on failure). ``path`` is one of :data:`PATHS`."""

    path: str
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    sequence_hashes: tuple[int, ...]
    plan_id: int | None = None

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise TransferPlanError(f"path must be one of {PATHS}, got {self.path!r}")
        src = _int_tuple("src_block_ids", self.src_block_ids)
        dst = _int_tuple("dst_block_ids", self.dst_block_ids)
        seq = _int_tuple("sequence_hashes", self.sequence_hashes, _U64)
        if not src:
            raise TransferPlanError("a plan must move at least one block")
        if not len(src) == len(dst) == len(seq):
            raise TransferPlanError(f"lengths differ: {len(src)} src ids, {len(dst)} dst ids, "
                                    f"{len(seq)} sequence hashes")
        if len(set(dst)) != len(dst):
            raise TransferPlanError("dst_block_ids contains duplicates")
        if self.plan_id is not None and (isinstance(self.plan_id, bool)
                                         or not isinstance(self.plan_id, int)):
            raise TransferPlanError(f"plan_id must be an int or None, got {self.plan_id!r}")
        object.__setattr__(self, "src_block_ids", src)
        object.__setattr__(self, "dst_block_ids", dst)
        object.__setattr__(self, "sequence_hashes", seq)

    def __len__(self) -> int:
        return len(self.src_block_ids)

    @property
    def src_tier(self) -> str:
        return self.path.split("->")[0]

    @property
    def dst_tier(self) -> str:
        return self.path.split("->")[1]

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {"path": self.path, "src_block_ids": list(self.src_block_ids),
                "dst_block_ids": list(self.dst_block_ids),
                "sequence_hashes": list(self.sequence_hashes), "plan_id": self.plan_id}

    @classmethod
    def from_dict(cls, data: Any) -> "TransferPlan":
        """Validate and rebuild a plan; raises :class:`TransferPlanError` naming the problem."""
        if not isinstance(data, dict):
            raise TransferPlanError(f"a plan must be a dict, got {type(data).__name__}")
        missing = (_PLAN_KEYS - {"plan_id"}) - set(data)
        unknown = set(data) - _PLAN_KEYS
        if missing or unknown:
            raise TransferPlanError(f"plan: missing keys {sorted(missing)}, "
                                    f"unknown keys {sorted(unknown)}")
        return cls(data["path"], data["src_block_ids"], data["dst_block_ids"],
                   data["sequence_hashes"], data.get("plan_id"))


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one plan. ``ok[i]`` is true iff block ``i`` is in place and verified;
    ``checksums[i]`` is the xxh3-64 of a block written into G2/G3 (``None`` otherwise);
    ``failures`` explain the false entries; ``error`` is set when the whole batch failed on
    an unexpected error."""

    plan: TransferPlan
    ok: tuple[bool, ...]
    checksums: tuple[int | None, ...]
    bytes_moved: int
    seconds: float
    failures: tuple[BlockFailure, ...] = field(default_factory=tuple)
    error: str | None = None

    @property
    def all_ok(self) -> bool:
        return all(self.ok)

    @property
    def failed_sequence_hashes(self) -> tuple[int, ...]:
        """Sequence hashes of the blocks that failed (do not register these)."""
        return tuple(h for h, good in zip(self.plan.sequence_hashes, self.ok) if not good)

    @property
    def ok_dst_block_ids(self) -> tuple[int, ...]:
        """Destination block ids that hold good bytes."""
        return tuple(b for b, good in zip(self.plan.dst_block_ids, self.ok) if good)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {"plan": self.plan.to_dict(), "ok": list(self.ok),
                "checksums": list(self.checksums), "bytes_moved": self.bytes_moved,
                "seconds": self.seconds, "failures": [f.to_dict() for f in self.failures],
                "error": self.error}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TransferResult":
        """Inverse of :meth:`to_dict`; raises :class:`TransferPlanError` on bad input."""
        try:
            plan = TransferPlan.from_dict(data["plan"])
            ok = tuple(bool(v) for v in data["ok"])
            checksums = tuple(None if v is None else int(v) for v in data["checksums"])
            failures = tuple(BlockFailure.from_dict(f) for f in data["failures"])
            result = cls(plan, ok, checksums, int(data["bytes_moved"]), float(data["seconds"]),
                         failures, data.get("error"))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, TransferPlanError):
                raise
            raise TransferPlanError(f"malformed transfer result: {exc!r}") from None
        if not len(ok) == len(checksums) == len(plan):
            raise TransferPlanError("transfer result lengths do not match its plan")
        return result
