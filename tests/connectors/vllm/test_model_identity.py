"""Stored pages are named by what computed them, not only by the model's name: new weights
put at the same path, or the same weights served with another RoPE, loaded the KV of the old
ones from a durable G3 (every prompt's output changed). vLLM's own configs, built without an
engine (``EngineArgs.create_engine_config``), of random-weight models written here."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from kvstrata.compat import WEIGHT_SAMPLE_BYTES, WEIGHT_SAMPLES, weights_identity  # noqa: E402
from kvstrata.connectors.vllm.identity import model_identity as _model_id  # noqa: E402
from kvstrata.testing.random_model import TINY, make_random_llama  # noqa: E402


def config_of(path, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(path), max_model_len=256, **kw).create_engine_config()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two random models of one shape (other seeds), in directories of their own."""
    root = tmp_path_factory.mktemp("models")
    return (make_random_llama(root / "a", TINY),
            make_random_llama(root / "b", replace(TINY, seed=TINY.seed + 1)))


def test_new_weights_at_the_same_path_are_another_model(models, tmp_path):
    a, b = models
    served = tmp_path / "current"
    shutil.copytree(a, served)
    before = _model_id(config_of(served))
    assert before == _model_id(config_of(served))           # the same on every call
    assert before.startswith(f"{served}#")
    for name in os.listdir(b):                               # the operator swaps the weights
        if name.endswith(".safetensors"):
            shutil.copyfile(b / name, served / name)
    assert _model_id(config_of(served)) != before


def test_the_same_weights_elsewhere_are_the_same_model_and_a_rope_override_is_not(models,
                                                                                   tmp_path):
    a, _ = models
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)                 # other path, other times: the same content
    assert weights_identity(str(copy)) == weights_identity(str(a)) != ""
    plain = _model_id(config_of(a))
    assert plain.split("#")[1] == _model_id(config_of(copy)).split("#")[1]
    assert _model_id(config_of(a, hf_overrides={"rope_theta": 500.0})) != plain


def test_a_large_weights_file_is_sampled_and_a_changed_piece_is_seen(tmp_path):
    size = WEIGHT_SAMPLES * WEIGHT_SAMPLE_BYTES * 4 + 123
    data = bytearray(os.urandom(size))
    (tmp_path / "model.safetensors").write_bytes(data)
    (tmp_path / "notes.txt").write_text("not weights")
    before = weights_identity(str(tmp_path))
    (tmp_path / "notes.txt").write_text("still not weights")
    assert weights_identity(str(tmp_path)) == before
    data[-1] ^= 0xFF                          # the last sampled piece ends the file
    (tmp_path / "model.safetensors").write_bytes(data)
    assert weights_identity(str(tmp_path)) != before
    assert weights_identity(str(tmp_path / "missing")) == ""
    (tmp_path / "model.safetensors").unlink()
    assert weights_identity(str(tmp_path)) == ""


def test_a_hub_model_is_named_by_the_weights_in_vllms_download_dir(models, tmp_path,
                                                                    monkeypatch):
    """vLLM reads a hub model's config from the hub's cache but keeps its weights in
    ``--download-dir`` when one is given: looked for in the default cache only, no weights
    were found, and new weights under the same name loaded the old KV."""
    from types import SimpleNamespace

    import huggingface_hub.constants

    a, b = models
    commit = "c" * 40

    def publish(cache, files):
        repo = cache / "models--org--tiny"
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        for path in files:
            shutil.copyfile(path, snapshot / path.name)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    publish(tmp_path / "hub", [a / "config.json"])          # the config: the default cache
    download = tmp_path / "download"

    def served(weights_from):
        publish(download, [p for p in weights_from.iterdir() if p.suffix == ".safetensors"])
        return _model_id(SimpleNamespace(
            model_config=SimpleNamespace(model="org/tiny", revision=None, quantization=None,
                                         hf_overrides=None, hf_config_path=None),
            load_config=SimpleNamespace(download_dir=str(download))))

    old = served(a)
    assert old.startswith("org/tiny#")
    assert served(b) != old


def test_a_model_constructor_changing_its_config_changes_no_name(models):
    """Some models' constructors write into vLLM's config in the workers (Falcon's
    ``num_ln_in_parallel_attn``), never in the engine core: the two halves of the connector
    named stored pages differently when the live config was hashed."""
    a, _ = models
    config = config_of(a)
    scheduler_view = _model_id(config)
    config.model_config.hf_config.num_ln_in_parallel_attn = 2      # as a worker's model does
    config.model_config.hf_config.rope_theta = 1.0
    assert _model_id(config) == scheduler_view


def test_overrides_given_as_functions_are_told_apart_by_what_they_set(models):
    """A callable ``hf_overrides`` was named by its qualified name only: two closures (or
    partials) of one function with other values named one model."""
    import functools

    a, _ = models

    def rope(theta):
        def set_theta(config):
            config.rope_theta = theta
            return config
        return set_theta

    def set_rope(config, theta):
        config.rope_theta = theta
        return config

    closures = {_model_id(config_of(a, hf_overrides=rope(t))) for t in (500.0, 1e6)}
    partials = {_model_id(config_of(a, hf_overrides=functools.partial(set_rope, theta=t)))
                for t in (500.0, 1e6)}
    assert len(closures) == 2 and len(partials) == 2
    assert _model_id(config_of(a, hf_overrides=rope(500.0))) in closures   # and stable


def test_online_quantization_options_are_part_of_the_name(models):
    a, _ = models
    whole = _model_id(config_of(a, quantization="fp8_per_tensor"))
    first_layer_left = _model_id(config_of(
        a, quantization="fp8_per_tensor",
        quantization_config={"ignore": ["re:.*layers\\.0\\..*"]}))
    assert len({_model_id(config_of(a)), whole, first_layer_left}) == 3


def test_a_stray_bin_beside_safetensors_is_not_another_model(models, tmp_path):
    """vLLM loads only the .safetensors where there are any: a pytorch_model.bin in one
    machine's copy made its servers name pages differently from the others'."""
    a, _ = models
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    (copy / "pytorch_model.bin").write_bytes(b"a leftover")
    assert weights_identity(str(copy)) == weights_identity(str(a))


def test_a_config_from_elsewhere_is_part_of_the_name(models, tmp_path):
    """``--hf-config-path``: the config read from there, not from the model's directory,
    decides the KV (a hub name there was not looked for, and two configs named one model)."""
    import json

    a, _ = models
    names = set()
    for theta in (10000.0, 1234.0):
        where = tmp_path / f"config-{int(theta)}"
        where.mkdir()
        config = json.loads((a / "config.json").read_text())
        config["rope_theta"] = theta
        (where / "config.json").write_text(json.dumps(config))
        names.add(_model_id(config_of(a, hf_config_path=str(where))))
    assert len(names) == 2
