"""The one table of element types a KV block may hold.

Canonical names are torch's (``float16``, ``bfloat16``, ``float32``, ``float8_e4m3fn``,
``float8_e5m2``); the short aliases ``fp16``, ``half``, ``bf16``, ``fp32``, ``float``, ``fp8``
(= ``float8_e4m3fn``), ``fp8_e4m3`` and ``fp8_e5m2`` are accepted on input. Config
validation, layouts and storages all read this table; the physical layer maps a canonical name
to a ``torch.dtype`` (:mod:`kvstrata.physical.dtypes`). This module imports nothing.
"""

from __future__ import annotations

__all__ = ["ITEMSIZE", "ALIASES", "DTYPE_NAMES", "DtypeError", "canonical_dtype", "itemsize"]

ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
"""Bytes per element, by canonical name."""

ALIASES: dict[str, str] = {
    "fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
    "float": "float32", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
"""Accepted short names, mapped to canonical names."""

DTYPE_NAMES: tuple[str, ...] = tuple(ITEMSIZE)
"""Canonical names."""


class DtypeError(ValueError):
    """A name that is neither a canonical dtype name nor an alias."""


def canonical_dtype(name: object) -> str:
    """The canonical name of ``name`` (an alias or a canonical name, any case)."""
    if not isinstance(name, str):
        raise DtypeError(f"dtype must be a name string, got {type(name).__name__}")
    lowered = name.lower()
    canon = ALIASES.get(lowered, lowered)
    if canon not in ITEMSIZE:
        raise DtypeError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPE_NAMES)} "
                         f"(or {', '.join(ALIASES)})")
    return canon


def itemsize(name: str) -> int:
    """Bytes per element of the dtype ``name`` (alias or canonical)."""
    return ITEMSIZE[canonical_dtype(name)]
