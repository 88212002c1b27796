"""What an executor reports back for a plan: per block, whether it arrived, and if not, why.

A :class:`TransferResult` answers one :class:`~kvstrata.protocol.plans.TransferPlan` (same
``job_id``): ``ok[i]`` is true iff block ``i`` is in place and verified, so the planner
registers exactly the good blocks. Failed blocks carry a :class:`BlockFailure` with a
:class:`FailureKind`. Both serialize to JSON types and back (a worker process reports to its
scheduler); importing this module loads neither torch nor prometheus_client.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .errors import TransferPlanError
from .plans import TransferPlan

__all__ = ["FailureKind", "BlockFailure", "TransferResult"]


class FailureKind(str, enum.Enum):
    """Why one block of a batch failed."""

    DISK_FULL = "disk_full"
    IO_ERROR = "io_error"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    NOT_WRITTEN = "not_written"
    HASH_MISMATCH = "hash_mismatch"
    INTERNAL = "internal"
    NOT_FOUND = "not_found"
    """The block is gone where it was read (e.g. no object under its key in G4)."""

    @property
    def bad_source(self) -> bool:
        """The bytes read at the source are wrong or gone (a checksum or identity check
        failed, or the object is missing): the block must be dropped where it was read
        from."""
        return self in _BAD_SOURCE


_BAD_SOURCE = frozenset({FailureKind.CHECKSUM_MISMATCH, FailureKind.HASH_MISMATCH,
                         FailureKind.NOT_WRITTEN, FailureKind.NOT_FOUND})


@dataclass(frozen=True)
class BlockFailure:
    """One failed block: its ``position`` in the batch, its ``block_id`` in the storage that
    failed, the ``kind`` of failure and a human-readable ``detail``."""

    position: int
    block_id: int
    kind: FailureKind
    detail: str

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {"position": self.position, "block_id": self.block_id,
                "kind": self.kind.value, "detail": self.detail}

    @classmethod
    def from_dict(cls, data: Any) -> "BlockFailure":
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on bad input."""
        try:
            return cls(int(data["position"]), int(data["block_id"]),
                       FailureKind(data["kind"]), str(data["detail"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed block failure {data!r}: {exc}") from None


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one plan. ``ok[i]`` is true iff block ``i`` is in place and verified;
    ``checksums[i]`` is the xxh3-64 of a block written into a host or disk tier (``None``
    otherwise); ``failures`` explain the false entries; ``error`` is set when the whole batch
    failed on an unexpected error. ``seconds`` is the time the executor spent on the plan;
    ``held_seconds`` the time it was held back on purpose besides (background writes wait
    while the engine's forward runs), which is not the path being slow; ``waited_seconds``
    the time the finished result waited for its driver to collect it (a vLLM engine that
    did not step for a while), which is not the path's latency either. ``moved_here`` is
    False when another worker holding the same bytes moved them (:meth:`done_elsewhere`):
    such a result says nothing of the path's speed."""

    plan: TransferPlan
    ok: tuple[bool, ...]
    checksums: tuple[int | None, ...]
    bytes_moved: int
    seconds: float
    failures: tuple[BlockFailure, ...] = field(default_factory=tuple)
    error: str | None = None
    held_seconds: float = 0.0
    waited_seconds: float = 0.0
    moved_here: bool = True

    @classmethod
    def success(cls, plan: TransferPlan, bytes_moved: int = 0, seconds: float = 0.0
                ) -> "TransferResult":
        """Every block of ``plan`` arrived (no checksums recorded)."""
        n = len(plan)
        return cls(plan, (True,) * n, (None,) * n, bytes_moved, seconds)

    @classmethod
    def failed(cls, plan: TransferPlan, kind: FailureKind, detail: str) -> "TransferResult":
        """No block of ``plan`` arrived, all for the same reason (e.g. it was never run)."""
        n = len(plan)
        ids = plan.dst_block_ids or (-1,) * n
        return cls(plan, (False,) * n, (None,) * n, 0, 0.0,
                   tuple(BlockFailure(p, ids[p], kind, detail) for p in range(n)), detail)

    @classmethod
    def done_elsewhere(cls, plan: TransferPlan) -> "TransferResult":
        """Every block of ``plan`` is in place, put there by another worker (one that holds
        the same bytes and writes them for both): nothing moved here."""
        n = len(plan)
        return cls(plan, (True,) * n, (None,) * n, 0, 0.0, moved_here=False)

    @property
    def job_id(self) -> int:
        return self.plan.job_id

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
                "error": self.error, "held_seconds": self.held_seconds,
                "waited_seconds": self.waited_seconds, "moved_here": self.moved_here}

    @classmethod
    def from_dict(cls, data: Any) -> "TransferResult":
        """Inverse of :meth:`to_dict`; raises :class:`TransferPlanError` on bad input."""
        try:
            plan = TransferPlan.from_dict(data["plan"])
            ok = tuple(_strict_bool(v) for v in data["ok"])
            checksums = tuple(None if v is None else int(v) for v in data["checksums"])
            failures = tuple(BlockFailure.from_dict(f) for f in data["failures"])
            result = cls(plan, ok, checksums, int(data["bytes_moved"]), float(data["seconds"]),
                         failures, data.get("error"), float(data.get("held_seconds", 0.0)),
                         float(data.get("waited_seconds", 0.0)),
                         _strict_bool(data.get("moved_here", True), "moved_here"))
        except TransferPlanError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferPlanError(f"malformed transfer result: {exc!r}") from None
        for name in ("held_seconds", "waited_seconds"):
            if not 0.0 <= getattr(result, name) < float("inf"):
                raise TransferPlanError(f"transfer result: {name} must be finite and >= 0, "
                                        f"got {getattr(result, name)!r}")
        if not len(ok) == len(checksums) == len(plan):
            raise TransferPlanError("transfer result lengths do not match its plan")
        if any(not 0 <= f.position < len(plan) or ok[f.position] for f in failures):
            raise TransferPlanError("transfer result: a failure names a position that is not "
                                    "a failed block of the plan")
        return result


def _strict_bool(value: Any, what: str = "ok entries") -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be booleans, got {value!r}")
    return value
