"""The served model's identity, for the name of the pages the connector stores.

Pages stored where they outlive the engine (a durable G3, a shared G4) may only be loaded by
an engine that would compute the same KV. The model's name and revision are not enough: new
weights put at the same path, a hub name whose files changed, or a RoPE override served the
old KV. :func:`model_identity` is ``name[@revision]#digest``, the digest over what was read
from disk and asked for: the model's config files as they are on disk, vLLM's
``hf_overrides``, the quantization, and the weights by content
(:func:`kvstrata.compat.weights_identity`).

Both halves of the connector (the engine core's scheduler and every worker) compute it on
their own, so it reads only what is the same for all of them: files, and settings given at
start. Not vLLM's live config object, which some models' constructors change in the workers
(Falcon's ``num_ln_in_parallel_attn``, LLaVA-like models' text configs) but not in the engine
core: the two halves then looked for stored pages under different names.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import xxhash

from ...compat import weights_identity

log = logging.getLogger(__name__)

CONFIG_FILES = ("config.json", "params.json")
"""A model directory's config files (Hugging Face's, Mistral's own format)."""


def model_identity(vllm_config: Any) -> str:
    """``name[@revision]`` of the served model, then ``#`` and 16 hex digits over its config
    files, overrides, quantization and weights (the digest is left out where vLLM gave
    none of them: a test double)."""
    model = getattr(vllm_config, "model_config", None)
    name = str(getattr(model, "model", "") or "")
    revision = getattr(model, "revision", None)
    named = f"{name}@{revision}" if revision else name
    digest = _made_by(vllm_config, model, name, revision)
    return f"{named}#{digest}" if digest else named


def _made_by(vllm_config: Any, model: Any, name: str, revision: str | None) -> str:
    if model is None:
        return ""
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    config_dir = getattr(model, "hf_config_path", None) or _local_copy(name, revision, None) \
        or _local_copy(name, revision, download_dir)
    weights_dir = _local_copy(name, revision, download_dir) if download_dir else None
    weights_dir = weights_dir or _local_copy(name, revision, None)
    parts: dict[str, Any] = {"config": _files_digest(config_dir, CONFIG_FILES)}
    overrides = getattr(model, "hf_overrides", None)
    if overrides:
        parts["overrides"] = overrides if not callable(overrides) \
            else f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}"
    quantization = getattr(model, "quantization", None)
    if quantization:
        parts["quantization"] = str(quantization)
    parts["weights"] = weights_identity(weights_dir) if weights_dir else ""
    if not parts["weights"]:
        log.info("kvstrata: no weights files found for %s: its stored pages are named by its "
                 "name, revision and config only (new weights under that name need a new "
                 "revision, or kvstrata's model_id)", name)
    text = json.dumps(parts, sort_keys=True, default=_plain, separators=(",", ":"))
    return f"{xxhash.xxh3_64_intdigest(text.encode()):016x}"


def _files_digest(directory: str | None, names: tuple[str, ...]) -> str:
    """xxh3-64 over the bytes of the files ``names`` in ``directory`` that exist ("" if
    none)."""
    if not directory or not os.path.isdir(directory):
        return ""
    digest = xxhash.xxh3_64()
    found = False
    for name in names:
        try:
            with open(os.path.join(directory, name), "rb") as fh:
                data = fh.read(16 << 20)          # a config file, bounded
        except OSError:
            continue
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
        found = True
    return f"{digest.intdigest():016x}" if found else ""


def _plain(value: Any) -> str:
    """An override JSON cannot hold, as text both halves (and other machines) write alike:
    its ``str``, or its type's name where that ``str`` names an address."""
    text = str(value)
    return type(value).__name__ if " at 0x" in text else text


def _local_copy(name: str, revision: str | None, cache_dir: str | None) -> str | None:
    """The model's directory (``name`` itself, or the directory of a model that is one file,
    a GGUF), or its snapshot in the hub's cache (``cache_dir``: vLLM's ``--download-dir``,
    else the default one); None if neither."""
    if os.path.isdir(name):
        return name
    if os.path.isfile(name):
        return os.path.dirname(os.path.abspath(name))
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, revision=revision, local_files_only=True,
                                 cache_dir=cache_dir)
    except Exception:            # not from the hub, or not in that cache
        return None
