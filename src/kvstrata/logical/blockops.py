"""The switch of the logical layer's optional native code.

Two extensions, both built by ``pip install -e .`` and both optional (without a compiler the
pure-Python versions run, with the same effects):

* ``kvstrata.logical._slots``: a pool's hash index and its loops over a batch of slots
  (:mod:`kvstrata.logical.slots` has the Python versions); a store picks its side when it
  is made;
* ``kvstrata.logical._blockops``: the adaptive policy's shadow caches
  (:mod:`kvstrata.logical.adaptive` has the Python versions) and the ``predicted-reuse``
  filter's history (:mod:`kvstrata.logical.reuse_prediction`).

The tests of ``tests/logical`` run on both paths (``use_native``).
"""

from __future__ import annotations

from ..types import BlockRecord

__all__ = ["NATIVE", "use_native", "native", "native_slots"]

_SHADOW_FUNCTIONS = ("lru_shadow_serve", "lfu_shadow_serve", "recent_held_then_add",
                     "reuse_admit_many")
_SLOT_NAMES = ("HashIndex", "SlotOps")


def _load():
    try:
        from . import _blockops, _slots
        for name in _SHADOW_FUNCTIONS:     # a stale build (an older .c) counts as not built
            getattr(_blockops, name)
        for name in _SLOT_NAMES:
            getattr(_slots, name)
        _slots.setup(BlockRecord)
    except (ImportError, AttributeError, TypeError):
        return None
    return _blockops, _slots


_loaded = _load()
_native = _loaded
NATIVE = _loaded is not None
"""Whether the native code is built."""


def native():
    """The shadow caches' native module when in use, else None."""
    return _native[0] if _native is not None else None


def native_slots():
    """The slot loops' native module when in use, else None (read when a store is made)."""
    return _native[1] if _native is not None else None


def use_native(enabled: bool) -> bool:
    """Turn the native code on or off (tests, benchmarks); returns the previous setting.
    Stores made before keep their side. Turning it on when it is not built raises
    ``RuntimeError``."""
    global _native
    previous = _native is not None
    if enabled:
        loaded = _load()
        if loaded is None:
            raise RuntimeError("the native slot loops (kvstrata.logical._slots, _blockops) "
                               "are not built")
        _native = loaded
    else:
        _native = None
    return previous
