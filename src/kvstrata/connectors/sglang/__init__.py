"""kvstrata in SGLang: a HiCache storage backend (:mod:`.backend`), loaded by SGLang's
``StorageBackendFactory`` as a dynamic backend. docs/sglang.md says how to run it.

Modules: :mod:`.backend` (the ``HiCacheStorage`` subclass), :mod:`.host_pool` (SGLang's host
pool as kvstrata's G1), :mod:`.settings` (the extra config)."""

from .backend import KvStrataStorage, page_hash

__all__ = ["KvStrataStorage", "page_hash"]
