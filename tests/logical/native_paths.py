"""Switching the native paths on and off, for tests/logical (conftest.py, test_pool.py)."""

import kvstrata.tokens as tokens
from kvstrata.logical import blockops

NATIVE_BUILT = blockops.NATIVE and tokens.NATIVE


def set_native(native: bool) -> tuple[bool, bool]:
    """Both native paths on or off; returns the previous settings for restore_native."""
    return blockops.use_native(native), tokens.use_native(native)


def restore_native(before: tuple[bool, bool]) -> None:
    blockops.use_native(before[0])
    tokens.use_native(before[1])
