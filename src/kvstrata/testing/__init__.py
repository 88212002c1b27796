"""Helpers for measuring and testing kvstrata: not used by kvstrata itself.

Benchmarks (``bench/``) and tests (``tests/``) import these; no module of kvstrata outside
this package imports it (checked by ``tests/test_testing_package.py``), so nothing here is
part of the library's behaviour or its public names.

* :mod:`kvstrata.testing.null_connector` -- ``NullConnector``, a vLLM v1 KV connector that
  finds, loads and stores nothing: the recompute baseline a connector is measured against.
  vLLM loads it by module path: ``{"kv_connector": "NullConnector",
  "kv_connector_module_path": "kvstrata.testing.null_connector", "kv_role": "kv_both"}``.
  Importing it needs vLLM installed.
* :mod:`kvstrata.testing.random_model` -- random-weight (seeded) checkpoints written to a
  local directory for vLLM to load, with a small tokenizer: a Llama, and Gemma-3 (sliding
  window), DeepSeek-V2 (MLA) and Qwen3-Next (linear attention) style models
  (``make_random_model``); ``TINY`` (tests) and ``BENCH`` (benchmarks) shapes. Nothing is
  downloaded.
* :mod:`kvstrata.testing.exporter` -- a prefill-shaped ``KvBlockManager`` in a process of its
  own that exports G2 over NIXL (``start_exporter``), a reader that leases and hangs
  (``start_lease_holder``), and the deterministic payloads (``payload_of``) any process can
  regenerate, for tests and benchmarks of remote reads (docs/remote.md).

* :mod:`kvstrata.testing.serve` -- ``VllmServer``: one ``vllm serve`` on 127.0.0.1 in its
  own process group, with kvstrata's connector (``kvstrata_connector(extra)``) or the null
  one, waited for by readiness.
* :mod:`kvstrata.testing.slowlink` -- ``SlowLink``, a TCP proxy adding latency and a
  bandwidth cap (the stand-in remote store's link in benchmarks); ``python -m
  kvstrata.testing.slowlink`` runs one as a process of its own.

Importing this package imports none of them: import the submodule you need
(``null_connector`` needs vLLM, ``exporter`` spawns processes).
"""
