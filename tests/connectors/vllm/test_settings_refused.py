"""Issue 28, item 3: every setting of the connector that would stop the engine later is
refused when the settings are parsed, with one ``ConnectorConfigError`` line that names the
key, and nothing is created. (Found accepted: an ``export`` port of 99999 or 0 or on an
address not of this host, ``peers`` with port 0, a ``disk_dir`` or G3 ``path`` that is a
regular file, an event file in a directory that does not exist, ``worker_id`` 2^70, a G4 url
with port 99999 or with user:password in it, a path with a NUL byte; in real ``vllm serve``
runs the first two killed the engine after 44-46 s with logs naming neither kvstrata nor the
key.)"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from kvstrata.connectors.vllm.settings import (ConnectorConfigError, KvGeometry,  # noqa: E402
                                               settings_from)

GEOMETRY = KvGeometry(32, 2, 2, 8, "bfloat16", 64)


def _refused(extra: dict, key: str, tmp_path, env: dict | None = None) -> str:
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ConnectorConfigError) as refused:
        settings_from(extra, GEOMETRY, env={} if env is None else env)
    message = str(refused.value)
    assert "\n" not in message, message
    assert key in message, message
    assert sorted(os.listdir(tmp_path)) == before          # nothing made
    return message


@pytest.mark.parametrize("export", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:0",
                                    "tcp://192.0.2.1:5555", "tcp://no-such-host.invalid:5555",
                                    "tcp://127.0.0.1:", "tcp://:5555"])
def test_an_export_address_this_host_cannot_listen_on_is_refused(export, tmp_path):
    _refused({"tiers": {"G2": {"blocks": 8}}, "export": export}, "export", tmp_path)


@pytest.mark.parametrize("peers", [["tcp://127.0.0.1:0"], ["tcp://h:70000"], "tcp://h:-1",
                                   ["tcp://h:1"] * 65])
def test_peers_with_a_port_out_of_range_are_refused(peers, tmp_path):
    _refused({"tiers": {"G2": {"blocks": 8}}, "peers": peers}, "peers", tmp_path)


SHARING = {"KVSTRATA_SHARING_SECRET": "the deployment's sharing secret"}


def test_an_export_on_loopback_is_accepted(tmp_path):
    settings = settings_from({"tiers": {"G2": {"blocks": 8}}, "export": "tcp://127.0.0.1:5555",
                              "peers": ["tcp://192.0.2.1:5555"]}, GEOMETRY, env=SHARING)
    assert settings.export == "tcp://127.0.0.1:5555"
    assert settings.peers == ("tcp://192.0.2.1:5555",)      # a peer may be another host


@pytest.mark.parametrize("key", ["export", "peers"])
def test_sharing_without_the_deployments_secret_is_refused(key, tmp_path):
    """Issue 27: an exporter serves nothing to a peer that cannot prove it holds the secret,
    so sharing G2 without one is a configuration error at start, in both engines."""
    value = "tcp://127.0.0.1:5555" if key == "export" else ["tcp://127.0.0.1:5555"]
    message = _refused({"tiers": {"G2": {"blocks": 8}}, key: value}, key, tmp_path)
    assert "KVSTRATA_SHARING_SECRET" in message
    message = _refused({"tiers": {"G2": {"blocks": 8}}, key: value}, key, tmp_path,
                       env={"KVSTRATA_SHARING_SECRET": "too short"})
    assert "16 to 4096 bytes" in message


@pytest.mark.parametrize("key,value", [("peer_ask_timeout", 0), ("peer_ask_timeout", -1),
                                       ("peer_ask_timeout", 61), ("peer_ask_timeout", True),
                                       ("peer_read_timeout", "5"), ("peer_read_timeout", 241),
                                       ("peer_read_timeout", float("nan"))])
def test_peer_timeouts_out_of_range_are_refused(key, value, tmp_path):
    _refused({"tiers": {"G2": {"blocks": 8}}, key: value}, key, tmp_path)


def test_peer_timeouts_reach_the_settings(tmp_path):
    default = settings_from({"tiers": {"G2": {"blocks": 8}}}, GEOMETRY, env={})
    assert (default.peer_ask_timeout, default.peer_read_timeout) == (0.2, 5.0)
    patient = settings_from({"tiers": {"G2": {"blocks": 8}}, "peer_ask_timeout": 2,
                             "peer_read_timeout": 240}, GEOMETRY, env={})
    assert (patient.peer_ask_timeout, patient.peer_read_timeout) == (2.0, 240.0)


def test_a_disk_directory_that_is_a_regular_file_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    for extra in ({"tiers": {"G2": {"blocks": 8}, "G3": {"blocks": 8}}, "disk_dir": str(afile)},
                  {"tiers": {"G2": {"blocks": 8}, "G3": {"blocks": 8, "path": str(afile)}}},
                  {"tiers": {"G2": {"blocks": 8}, "G3": {"blocks": 8}},
                   "disk_dir": str(afile / "sub")}):
        message = _refused(extra, "G3", tmp_path)
        assert "is not a directory" in message


@pytest.mark.parametrize("extra, key", [
    ({"disk_dir": "/tmp/a\0b"}, "disk_dir"),
    ({"tiers": {"G2": {"blocks": 8}, "G3": {"blocks": 8, "path": "/tmp/a\0b"}}}, "path"),
    ({"events": "jsonl:/nonexistent/dir/x"}, "events"),
    ({"events": ["jsonl:/tmp/a\0b"]}, "events"),
    ({"worker_id": 2**70}, "worker_id"),
    ({"worker_id": -1}, "worker_id"),
    ({"tiers": {"G2": {"blocks": 8}, "G4": {"blocks": 8, "url": "http://h:99999/bucket"}}},
     "url"),
    ({"tiers": {"G2": {"blocks": 8}, "G4": {"blocks": 8, "url": "http://u:p@h:9000/bucket"}}},
     "url"),
])
def test_settings_that_would_fail_later_are_refused_now(extra, key, tmp_path):
    _refused(extra, key, tmp_path)


def test_an_event_file_in_an_existing_directory_is_accepted_and_not_created(tmp_path):
    target = tmp_path / "events.jsonl"
    settings = settings_from({"events": f"jsonl:{target}"}, GEOMETRY, env={})
    assert settings.events == (f"jsonl:{target}",)
    assert not target.exists()
