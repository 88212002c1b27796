"""Which copy engine a machine uses by default.

On its own so that neither engine module imports the other: :mod:`.copy` holds the host
engines, :mod:`.device_copy` the GPU one (which falls back to a host engine).
"""

from __future__ import annotations

import torch

from .copy import CopyEngine, MemmoveCopyEngine, StagedCopyEngine
from .device_copy import DeviceCopyEngine, device_kernel_status

__all__ = ["default_copy_engine"]


def default_copy_engine() -> CopyEngine:
    """With CUDA, :class:`~.device_copy.DeviceCopyEngine` (falling back to
    :class:`~.copy.StagedCopyEngine` for memory it cannot address), or ``StagedCopyEngine``
    alone where Triton is missing; without CUDA, :class:`~.copy.MemmoveCopyEngine`."""
    if not torch.cuda.is_available():
        return MemmoveCopyEngine()
    if device_kernel_status()["available"]:
        return DeviceCopyEngine()
    return StagedCopyEngine()
