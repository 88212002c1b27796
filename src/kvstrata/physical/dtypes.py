"""Element types as torch sees them: the canonical names of :mod:`kvstrata.dtypes` mapped to
``torch.dtype``. A name the table knows but the installed torch lacks (an fp8 type on an old
build) is refused here, when memory is allocated, with a :class:`LayoutConfigError`."""

from __future__ import annotations

import torch

from ..dtypes import DTYPE_NAMES, DtypeError, canonical_dtype
from .errors import LayoutConfigError

__all__ = ["SUPPORTED_DTYPES", "torch_dtype", "dtype_name"]

_TORCH: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES
                                  if isinstance(getattr(torch, name, None), torch.dtype)}

SUPPORTED_DTYPES: tuple[str, ...] = tuple(_TORCH)
"""Canonical names of the dtypes this torch build supports."""


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` for a dtype name (alias or canonical)."""
    try:
        canon = canonical_dtype(name)
    except DtypeError as exc:
        raise LayoutConfigError(str(exc)) from None
    if canon not in _TORCH:
        raise LayoutConfigError(f"dtype {canon} is not available in torch {torch.__version__}; "
                                f"supported here: {', '.join(SUPPORTED_DTYPES)}")
    return _TORCH[canon]


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a ``torch.dtype`` (raises if unsupported)."""
    for name, value in _TORCH.items():
        if value == dtype:
            return name
    raise LayoutConfigError(f"unsupported torch dtype {dtype}; supported: "
                            f"{', '.join(SUPPORTED_DTYPES)}")
