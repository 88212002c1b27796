"""Transfer plans: which blocks move from which tier of which worker to which other one.

A :class:`TransferPlan` is what the placement planner hands to an executor: copy block ``i``
(named by ``sequence_hashes[i]``) from the source endpoint to the target endpoint. Each side
addresses its blocks the way its tier does (:mod:`kvstrata.tiers`): slot-addressed tiers by
block ids (``src_block_ids`` / ``dst_block_ids``), key-addressed ones by string keys
(``src_keys`` / ``dst_keys``). A plan into a tier whose blocks outlive the process (a durable
disk tier, an object store) also carries each block's identity -- ``parent_hashes`` and
``local_hashes`` -- so the stored block can be announced again, with its place in the chain,
by whoever finds it later. ``job_id`` names the plan; its
:class:`~kvstrata.protocol.results.TransferResult` comes back under the same id.

Plans cross process boundaries (a scheduler plans, its workers execute), so they are plain,
validated and serializable: :meth:`TransferPlan.to_dict` gives JSON types, and
:meth:`TransferPlan.from_dict` rebuilds a plan or raises
:class:`~kvstrata.protocol.errors.TransferPlanError` naming the problem. Importing this module
loads neither torch nor prometheus_client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..tiers import Addressing, UnknownTierError, path_name, spec, split_path
from ..types import U64_LIMIT
from .errors import TransferPlanError

__all__ = ["PLAN_VERSION", "Endpoint", "TransferPlan"]

PLAN_VERSION = 1
"""Version of the plan's dict form; :meth:`TransferPlan.from_dict` refuses any other."""

_INT_ONLY = {int}
_PLAN_KEYS = {"version", "job_id", "source", "target", "sequence_hashes", "src_block_ids",
              "dst_block_ids", "src_keys", "dst_keys", "parent_hashes", "local_hashes"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_tuple(name: str, values: Any, upper: int | None = None) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TransferPlanError(f"{name} must be a list of ints, got {type(values).__name__}")
    out = tuple(values)
    # Fast path (C loops, ~50 ns per element): all plain ints (no bools) within range.
    if out and set(map(type, out)) <= _INT_ONLY and min(out) >= 0 \
            and (upper is None or max(out) < upper):
        return out
    for i, v in enumerate(out):
        if not _is_int(v):
            raise TransferPlanError(f"{name}[{i}] must be an int, got {v!r}")
        if v < 0 or (upper is not None and v >= upper):
            raise TransferPlanError(f"{name}[{i}] = {v} is out of range")
    return out


def _parent_tuple(values: Any) -> tuple[int | None, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TransferPlanError(f"parent_hashes must be a list, got {type(values).__name__}")
    out = tuple(values)
    for i, v in enumerate(out):
        if v is not None and (not _is_int(v) or not 0 <= v < U64_LIMIT):
            raise TransferPlanError(f"parent_hashes[{i}] must be a u64 or null, got {v!r}")
    return out


def _key_tuple(name: str, values: Any) -> tuple[str, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TransferPlanError(f"{name} must be a list of strings, got {type(values).__name__}")
    out = tuple(values)
    for i, v in enumerate(out):
        if not isinstance(v, str) or not v:
            raise TransferPlanError(f"{name}[{i}] must be a non-empty string, got {v!r}")
    return out


@dataclass(frozen=True)
class Endpoint:
    """One side of a transfer: a tier (a name of :data:`kvstrata.tiers.TIER_NAMES`) on a
    worker (0 is the process that owns the storage; other ids name other workers)."""

    tier: str
    worker: int = 0

    def __post_init__(self) -> None:
        try:
            spec(self.tier)
        except UnknownTierError as exc:
            raise TransferPlanError(f"endpoint: {exc}") from None
        if not _is_int(self.worker) or self.worker < 0:
            raise TransferPlanError(f"endpoint worker must be an int >= 0, got {self.worker!r}")

    @property
    def addressing(self) -> Addressing:
        return spec(self.tier).addressing

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "worker": self.worker}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "Endpoint":
        if not isinstance(data, dict) or set(data) != {"tier", "worker"}:
            raise TransferPlanError(f"plan {where} must be {{'tier': ..., 'worker': ...}}, "
                                    f"got {data!r}")
        return cls(data["tier"], data["worker"])


@dataclass(frozen=True)
class TransferPlan:
    """Copy block ``i`` of ``source`` to ``target``; ``sequence_hashes[i]`` names it (stored
    with it, checked on reads, reported on failure). Slot-addressed sides fill the
    ``*_block_ids`` field, key-addressed sides the ``*_keys`` field (the other stays empty).
    ``parent_hashes`` / ``local_hashes`` are empty, or give every block's identity."""

    job_id: int
    source: Endpoint
    target: Endpoint
    sequence_hashes: tuple[int, ...]
    src_block_ids: tuple[int, ...] = ()
    dst_block_ids: tuple[int, ...] = ()
    src_keys: tuple[str, ...] = ()
    dst_keys: tuple[str, ...] = ()
    parent_hashes: tuple[int | None, ...] = ()
    local_hashes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.job_id) or self.job_id < 0:
            raise TransferPlanError(f"job_id must be an int >= 0, got {self.job_id!r}")
        for name in ("source", "target"):
            if not isinstance(getattr(self, name), Endpoint):
                raise TransferPlanError(f"{name} must be an Endpoint, got "
                                        f"{type(getattr(self, name)).__name__}")
        if self.source == self.target:
            raise TransferPlanError(f"source and target are the same endpoint {self.source}")
        seqs = _int_tuple("sequence_hashes", self.sequence_hashes, U64_LIMIT)
        if not seqs:
            raise TransferPlanError("a plan must move at least one block")
        object.__setattr__(self, "sequence_hashes", seqs)
        for side, endpoint in (("src", self.source), ("dst", self.target)):
            ids_name, keys_name = f"{side}_block_ids", f"{side}_keys"
            if endpoint.addressing is Addressing.SLOTS:
                field, unused = ids_name, keys_name
                values: tuple = _int_tuple(ids_name, getattr(self, ids_name))
            else:
                field, unused = keys_name, ids_name
                values = _key_tuple(keys_name, getattr(self, keys_name))
            if getattr(self, unused):
                raise TransferPlanError(f"{endpoint.tier} is addressed by "
                                        f"{endpoint.addressing.value}: {unused} must be empty")
            if len(values) != len(seqs):
                raise TransferPlanError(f"lengths differ: {len(seqs)} sequence hashes, "
                                        f"{len(values)} {field}")
            if side == "dst" and len(set(values)) != len(values):
                raise TransferPlanError(f"{field} contains duplicates")
            object.__setattr__(self, field, values)
            object.__setattr__(self, unused, ())
        parents = _parent_tuple(self.parent_hashes)
        locals_ = _int_tuple("local_hashes", self.local_hashes, U64_LIMIT)
        if len(parents) != len(locals_) or (parents and len(parents) != len(seqs)):
            raise TransferPlanError(f"parent_hashes ({len(parents)}) and local_hashes "
                                    f"({len(locals_)}) must both be empty or give one value "
                                    f"per block ({len(seqs)})")
        object.__setattr__(self, "parent_hashes", parents)
        object.__setattr__(self, "local_hashes", locals_)

    @property
    def has_identities(self) -> bool:
        """Whether the plan carries each block's parent and local hash."""
        return bool(self.local_hashes)

    @classmethod
    def for_path(cls, path: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                 sequence_hashes: Sequence[int], *, job_id: int, worker: int = 0
                 ) -> "TransferPlan":
        """A plan between two slot-addressed tiers of one worker, e.g.
        ``TransferPlan.for_path("G1->G2", [3, 7], [0, 1], [h3, h7], job_id=1)``."""
        try:
            source, target = split_path(path)
        except (ValueError, UnknownTierError) as exc:
            raise TransferPlanError(str(exc)) from None
        return cls(job_id, Endpoint(source, worker), Endpoint(target, worker), sequence_hashes,
                   src_block_ids=src_block_ids, dst_block_ids=dst_block_ids)

    @classmethod
    def trusted(cls, job_id: int, source: Endpoint, target: Endpoint,
                sequence_hashes: tuple[int, ...], src_block_ids: tuple[int, ...] = (),
                dst_block_ids: tuple[int, ...] = (), src_keys: tuple[str, ...] = (),
                dst_keys: tuple[str, ...] = (), parent_hashes: tuple[int | None, ...] = (),
                local_hashes: tuple[int, ...] = ()) -> "TransferPlan":
        """Build a plan without validation, from values the caller has already checked (the
        planner's own pool ids and registered hashes). Everything that arrives from outside
        goes through the constructor or :meth:`from_dict` instead."""
        plan = object.__new__(cls)
        plan.__dict__.update(job_id=job_id, source=source, target=target,
                             sequence_hashes=sequence_hashes, src_block_ids=src_block_ids,
                             dst_block_ids=dst_block_ids, src_keys=src_keys, dst_keys=dst_keys,
                             parent_hashes=parent_hashes, local_hashes=local_hashes)
        return plan

    def __len__(self) -> int:
        return len(self.sequence_hashes)

    @property
    def path(self) -> str:
        """``"G1->G2"``: the source and target tiers (the workers are in the endpoints)."""
        return path_name(self.source.tier, self.target.tier)

    @property
    def src_tier(self) -> str:
        return self.source.tier

    @property
    def dst_tier(self) -> str:
        return self.target.tier

    @property
    def src_addresses(self) -> tuple:
        """The source blocks as their tier addresses them: slot ids, or keys."""
        return self.src_keys if self.source.addressing is Addressing.KEYS else self.src_block_ids

    @property
    def dst_addresses(self) -> tuple:
        """The target blocks as their tier addresses them: slot ids, or keys."""
        return self.dst_keys if self.target.addressing is Addressing.KEYS else self.dst_block_ids

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (see :data:`PLAN_VERSION`)."""
        return {"version": PLAN_VERSION, "job_id": self.job_id,
                "source": self.source.to_dict(), "target": self.target.to_dict(),
                "sequence_hashes": list(self.sequence_hashes),
                "src_block_ids": list(self.src_block_ids),
                "dst_block_ids": list(self.dst_block_ids),
                "src_keys": list(self.src_keys), "dst_keys": list(self.dst_keys),
                "parent_hashes": list(self.parent_hashes),
                "local_hashes": list(self.local_hashes)}

    @classmethod
    def from_dict(cls, data: Any) -> "TransferPlan":
        """Validate and rebuild a plan; raises :class:`TransferPlanError` naming the problem."""
        if not isinstance(data, dict):
            raise TransferPlanError(f"a plan must be a dict, got {type(data).__name__}")
        missing = {"version", "job_id", "source", "target", "sequence_hashes"} - set(data)
        unknown = set(data) - _PLAN_KEYS
        if missing or unknown:
            raise TransferPlanError(f"plan: missing keys {sorted(missing)}, "
                                    f"unknown keys {sorted(unknown)}")
        if data["version"] != PLAN_VERSION:
            raise TransferPlanError(f"plan version {data['version']!r} is not supported; this "
                                    f"build reads version {PLAN_VERSION}")
        return cls(data["job_id"], Endpoint.from_dict(data["source"], "source"),
                   Endpoint.from_dict(data["target"], "target"), data["sequence_hashes"],
                   data.get("src_block_ids", ()), data.get("dst_block_ids", ()),
                   data.get("src_keys", ()), data.get("dst_keys", ()),
                   data.get("parent_hashes", ()), data.get("local_hashes", ()))
