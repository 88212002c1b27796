"""The name of stored pages covers the KV cache layout vLLM resolved: a page stored under
one layout (tokens before heads, or heads before tokens) passes every checksum under the
other, so only the name keeps a G3 kept across a change, or a G4 shared by servers on
different GPUs, from loading pages in the wrong order."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

from kvstrata.connectors.vllm.connector import _block_layout  # noqa: E402


def resolved(monkeypatch, layout_env: str | None):
    """A config as vLLM's engine core leaves it after resolving the layout for a backend
    that takes either layout (FlashAttention's), with ``VLLM_KV_CACHE_LAYOUT`` as given."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    if layout_env is None:
        monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", layout_env)
    config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(kv_cache_layout=None), kv_transfer_config=None)
    layout = resolve_kv_cache_layout(config, [["LBNHC", "LBHNC"]])
    config.cache_config.kv_cache_layout = layout.name
    return config


def test_pages_of_another_kv_cache_layout_have_another_name(monkeypatch):
    default = _block_layout(resolved(monkeypatch, None), None)
    heads_first = _block_layout(resolved(monkeypatch, "HND"), None)
    assert default != heads_first
    assert "LBNHC" in default and "LBHNC" in heads_first


def test_a_worker_names_pages_from_the_kv_cache_config_it_was_given():
    """A worker spawned after resolution sees the layout only in its KVCacheConfig."""
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(kv_cache_layout=None))
    given = types.SimpleNamespace(kv_cache_layout="LBHNC")
    assert _block_layout(config, given) == _block_layout(
        types.SimpleNamespace(cache_config=types.SimpleNamespace(kv_cache_layout="LBHNC")),
        None)
