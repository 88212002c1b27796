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
    config_path = getattr(model, "hf_config_path", None)
    config_revision = getattr(model, "_hf_config_revision", None) or revision
    in_cache = _local_copy(name, revision, None)
    downloaded = _local_copy(name, revision, download_dir) if download_dir else None
    weights_dir = downloaded or in_cache          # vLLM loads weights from --download-dir
    if config_path:
        config_dir = _local_copy(config_path, config_revision, None) or (
            _local_copy(config_path, config_revision, download_dir) if download_dir else None)
    else:
        config_dir = in_cache or downloaded
    parts: dict[str, Any] = {"config": _files_digest(config_dir, CONFIG_FILES)}
    if config_path:
        parts["config_path"] = str(config_path)
    if not parts["config"]:
        log.warning("kvstrata: no config file found for %s: its stored pages are named by its "
                    "name and weights only (a config change under that name needs a new "
                    "kvstrata model_id)", config_path or name)
    overrides = getattr(model, "hf_overrides", None)
    if overrides:
        parts["overrides"] = _callable_identity(overrides) if callable(overrides) else overrides
    for key in ("quantization", "quantization_config"):
        value = getattr(model, key, None)
        if value:
            parts[key] = value
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


def _callable_identity(function: Any) -> dict[str, Any]:
    """An ``hf_overrides`` function as both halves see it alike: its name, its code (bytes
    and constants), its defaults and the values it closes over (a ``functools.partial``:
    the function and the arguments it fixes). Two closures or partials of one function with
    other values are then told apart, not only two functions of other names."""
    import functools

    if isinstance(function, functools.partial):
        return {"partial": _callable_identity(function.func), "args": function.args,
                "keywords": function.keywords}
    code = getattr(function, "__code__", None)
    cells = getattr(function, "__closure__", None) or ()
    values = []
    for cell in cells:
        try:
            values.append(cell.cell_contents)
        except ValueError:                    # a cell not filled yet
            values.append(None)
    return {"name": f"{getattr(function, '__module__', '')}."
                    f"{getattr(function, '__qualname__', type(function).__name__)}",
            "code": code.co_code.hex() if code is not None else "",
            "constants": code.co_consts if code is not None else (),
            "defaults": getattr(function, "__defaults__", None),
            "closure": values}


def _plain(value: Any) -> Any:
    """A value JSON cannot hold, as both halves (and other machines) write it alike: a
    dataclass's fields, else its ``str``, or its type's name where that ``str`` names an
    address."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__, **dataclasses.asdict(value)}
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
