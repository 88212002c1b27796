"""kvstrata as a vLLM v1 KV connector (``kv_connector_module_path: kvstrata.connectors.vllm``,
``kv_connector: KvStrataConnector``); see docs/vllm.md.

Importing this package loads nothing of vLLM; ``KvStrataConnector`` is imported on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvStrataConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvStrataConnector":
        from .connector import KvStrataConnector

        return KvStrataConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
