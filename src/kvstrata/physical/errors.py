"""Typed errors of the physical layer, and the per-block failure record.

Every error a caller can act on has its own class, all rooted at :class:`PhysicalError`:

* :class:`LayoutError` — a geometry problem: :class:`LayoutConfigError` (invalid numbers),
  :class:`LayoutMismatchError` (two layouts that cannot exchange blocks),
  :class:`LayoutFormatError` (malformed serialized layout), :class:`LayoutVersionError`
  (a serialized layout from an unsupported format version).
* :class:`StorageError` — a backend problem: :class:`StorageConfigError`,
  :class:`StorageClosedError` and :class:`BlockIOError`, which says *which blocks of a batch*
  failed (``failures``). Its subclasses name the cause: :class:`DiskFullError` (ENOSPC),
  :class:`StorageIOError` (EIO and other OS errors, short reads),
  :class:`BlockIntegrityError` (slot empty or holding another block) and its subclass
  :class:`ChecksumMismatchError` (bytes differ from their recorded xxh3-64).
* :class:`TransferError` — :class:`TransferPlanError` (malformed or out-of-range plan),
  :class:`EngineClosedError`, :class:`EngineBusyError` (bounded queue full).

A :class:`BlockFailure` is a plain, serializable record (position in the batch, block id,
kind, detail) so a worker process can report failures back to a scheduler process.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable, Sequence


class PhysicalError(Exception):
    """Root of every error raised by ``kvstrata.physical``."""


# --------------------------------------------------------------------------- layouts
class LayoutError(PhysicalError, ValueError):
    """A layout is invalid, incompatible or cannot be decoded."""


class LayoutConfigError(LayoutError):
    """A :class:`~kvstrata.physical.layout.LayoutConfig` field is out of range."""


class LayoutMismatchError(LayoutError):
    """Two layouts differ in geometry or dtype, so blocks cannot be copied between them."""


class LayoutFormatError(LayoutError):
    """A serialized layout is malformed (missing/unknown keys, wrong types, bad sizes)."""


class LayoutVersionError(LayoutFormatError):
    """A serialized layout uses a format version this code does not understand."""


# --------------------------------------------------------------------------- storage
class StorageError(PhysicalError):
    """A storage backend could not be created or used."""


class StorageConfigError(StorageError, ValueError):
    """Invalid storage arguments (e.g. O_DIRECT demanded where the filesystem refuses it)."""


class StorageClosedError(StorageError):
    """The storage was closed; its memory or file is gone."""


class FailureKind(str, enum.Enum):
    """Why one block of a batch failed."""

    DISK_FULL = "disk_full"
    IO_ERROR = "io_error"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    NOT_WRITTEN = "not_written"
    HASH_MISMATCH = "hash_mismatch"
    INTERNAL = "internal"


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
    def from_dict(cls, data: dict[str, Any]) -> "BlockFailure":
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on bad input."""
        try:
            return cls(int(data["position"]), int(data["block_id"]),
                       FailureKind(data["kind"]), str(data["detail"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed block failure {data!r}: {exc}") from None


class BlockIOError(StorageError):
    """Some blocks of a batch failed; the others completed and are valid.

    ``failures`` lists the failed blocks (position in the batch and block id). For writes,
    ``checksums`` holds, per position, the xxh3-64 of each block written successfully and
    ``None`` for the failed ones, so the caller can register exactly the good blocks.
    """

    def __init__(self, message: str, failures: Sequence[BlockFailure],
                 checksums: Sequence[int | None] | None = None) -> None:
        super().__init__(message)
        self.failures: tuple[BlockFailure, ...] = tuple(failures)
        self.checksums: tuple[int | None, ...] | None = (
            None if checksums is None else tuple(checksums))

    @property
    def failed_positions(self) -> tuple[int, ...]:
        """Positions (in the batch) of the failed blocks."""
        return tuple(f.position for f in self.failures)

    @property
    def failed_block_ids(self) -> tuple[int, ...]:
        """Block ids (in the failing storage) of the failed blocks."""
        return tuple(f.block_id for f in self.failures)


class DiskFullError(BlockIOError):
    """The filesystem ran out of space (ENOSPC/EDQUOT) while writing or preallocating."""


class StorageIOError(BlockIOError):
    """An I/O error (EIO, short read/write, any other OS error) on some blocks."""


class BlockIntegrityError(BlockIOError):
    """A slot holds no valid block, or holds a different block than the one asked for."""


class ChecksumMismatchError(BlockIntegrityError):
    """The bytes read back differ from the checksum recorded when they were written."""


_ERROR_BY_KIND: dict[FailureKind, type[BlockIOError]] = {
    FailureKind.DISK_FULL: DiskFullError,
    FailureKind.IO_ERROR: StorageIOError,
    FailureKind.INTERNAL: StorageIOError,
    FailureKind.CHECKSUM_MISMATCH: ChecksumMismatchError,
    FailureKind.NOT_WRITTEN: BlockIntegrityError,
    FailureKind.HASH_MISMATCH: BlockIntegrityError,
}
_SEVERITY = [FailureKind.DISK_FULL, FailureKind.IO_ERROR, FailureKind.INTERNAL,
             FailureKind.CHECKSUM_MISMATCH, FailureKind.HASH_MISMATCH, FailureKind.NOT_WRITTEN]


def raise_for_failures(operation: str, failures: Iterable[BlockFailure], batch_size: int,
                       checksums: Sequence[int | None] | None = None) -> None:
    """Raise the :class:`BlockIOError` subclass matching the most severe failure, if any."""
    failures = sorted(failures, key=lambda f: f.position)
    if not failures:
        return
    worst = min(failures, key=lambda f: _SEVERITY.index(f.kind))
    cls = _ERROR_BY_KIND[worst.kind]
    raise cls(f"{operation}: {len(failures)} of {batch_size} blocks failed; first: block "
              f"{failures[0].block_id} ({failures[0].kind.value}: {failures[0].detail})",
              failures, checksums)


# --------------------------------------------------------------------------- transfers
class TransferError(PhysicalError):
    """A transfer could not be submitted."""


class TransferPlanError(TransferError, ValueError):
    """A :class:`~kvstrata.physical.transfer.TransferPlan` is malformed or out of range."""


class EngineClosedError(TransferError):
    """The transfer engine was closed."""


class EngineBusyError(TransferError):
    """The path's bounded queue stayed full for the whole submit timeout."""
