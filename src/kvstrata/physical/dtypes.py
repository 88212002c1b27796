"""Element types a KV block may hold, by name.

Canonical names are torch's: ``float16``, ``bfloat16``, ``float32``, ``float8_e4m3fn``;
the short aliases ``fp16``, ``bf16``, ``fp32``, ``fp8`` are accepted on input. ``fp8`` is
available only when the installed torch has ``torch.float8_e4m3fn``.
"""

from __future__ import annotations

import torch

from .errors import LayoutConfigError

_CANONICAL: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
if hasattr(torch, "float8_e4m3fn"):
    _CANONICAL["float8_e4m3fn"] = torch.float8_e4m3fn

_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
            "float": "float32", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}

_ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in _CANONICAL.items()}

SUPPORTED_DTYPES: tuple[str, ...] = tuple(_CANONICAL)
"""Canonical names of the dtypes this torch build supports."""


def canonical_dtype_name(name: str) -> str:
    """Return the canonical name for ``name`` (an alias or canonical name)."""
    if not isinstance(name, str):
        raise LayoutConfigError(f"dtype must be a name string, got {type(name).__name__}")
    canon = _ALIASES.get(name.lower(), name.lower())
    if canon not in _CANONICAL:
        raise LayoutConfigError(
            f"unsupported dtype {name!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    return canon


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` for a dtype name."""
    return _CANONICAL[canonical_dtype_name(name)]


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a ``torch.dtype`` (raises if unsupported)."""
    for name, value in _CANONICAL.items():
        if value == dtype:
            return name
    raise LayoutConfigError(f"unsupported torch dtype {dtype}; supported: "
                            f"{', '.join(SUPPORTED_DTYPES)}")


def itemsize(name: str) -> int:
    """Bytes per element of a dtype name."""
    return _ITEMSIZE[canonical_dtype_name(name)]
