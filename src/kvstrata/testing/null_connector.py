"""``NullConnector``: a vLLM KV connector that loads and stores nothing.

The fair recompute baseline for benchmarks: on vLLM's CPU build, configuring *any* KV
connector changes how prefill runs (measured here about 1.8x faster than with no connector),
so a connector's gains are measured against this one, never against plain vLLM. Name it with
``{"kv_connector": "NullConnector", "kv_connector_module_path":
"kvstrata.testing.null_connector", "kv_role": "kv_both"}``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               SupportsHMA)

__all__ = ["NullConnector"]


class _NoOrders(KVConnectorMetadata):
    pass


class NullConnector(KVConnectorBase_V1, SupportsHMA):
    """Finds nothing, loads nothing, stores nothing. Declares ``SupportsHMA``, as kvstrata's
    connector does: vLLM keeps its hybrid KV cache manager on for both (a fair baseline)."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NoOrders()

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None
