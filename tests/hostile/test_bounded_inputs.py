"""Issue 28, items 1 and 5, as classes: every count and size from outside has an upper bound
checked before anything is allocated, and every input is read within a bound of length and
time (FIFOs and devices included). Each case runs the real command in a process whose
address space is capped (``RLIMIT_AS``, as ``prlimit --as`` does), so an unbounded read or
allocation fails this test instead of taking the machine: it must end with exit status 2
and one line on stderr naming the input and its bound.

(Found before: ``--workers 99999999999999999999`` drove the host into the OOM killer;
``replay /dev/zero``, ``--config /dev/zero``, ``KVSTRATA_CONFIG=/dev/zero`` and ``indexer
--file /dev/zero`` read without a bound; a FIFO as ``--config`` hung; a 50 MB file of NUL
bytes was read whole; ``block_size = 99999999999999999999`` gave "Python int too large to
convert to C ssize_t"; ``indexer --nats 'nats://['`` a 54-line traceback.)"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

CAP = 3 << 30
"""Address space of each command (bytes): kvstrata's replay needs well under a gigabyte."""
TIMEOUT = 120
"""Generous for a loaded CI machine; a hang (a FIFO waited on) would run into it."""


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))


def run(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstrata.cli", *argv], capture_output=True,
                          text=True, timeout=TIMEOUT, preexec_fn=_capped,
                          env={**os.environ, **(env or {})})


def refused(argv: list[str], words: str, env: dict | None = None) -> str:
    proc = run(argv, env)
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert len(err.splitlines()) == 1, err[-2000:]
    assert words in err, err
    return err


@pytest.fixture(scope="module")
def nuls(tmp_path_factory):
    """50 MB of NUL bytes: no newline, no TOML, no JSON."""
    path = tmp_path_factory.mktemp("nuls") / "nuls"
    with open(path, "wb") as fh:
        fh.truncate(50_000_000)
    return str(path)


@pytest.fixture()
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return str(path)


@pytest.mark.parametrize("workers", ["99999999999999999999", "1000000", "1025", "0"])
def test_worker_counts_are_bounded(workers):
    refused(["replay", "--workers", workers, "--limit", "1"], "--workers must be in 1..1,024")


@pytest.mark.parametrize("argv, env, words", [
    (["replay", "/dev/zero"], None, "not a regular file"),
    (["replay", "--config", "/dev/zero", "--limit", "1"], None, "not a regular file"),
    (["replay", "--limit", "1"], {"KVSTRATA_CONFIG": "/dev/zero"}, "not a regular file"),
    (["indexer", "--file", "/dev/zero"], None, "not a regular file"),
])
def test_devices_are_not_read(argv, env, words):
    refused(argv, words, env)


def test_a_fifo_is_not_waited_on(fifo):
    refused(["replay", "--config", fifo, "--limit", "1"], "not a regular file")
    refused(["replay", fifo], "not a regular file")
    refused(["indexer", "--file", fifo], "not a regular file")


def test_a_large_file_of_nul_bytes_is_read_only_up_to_its_bound(nuls):
    refused(["replay", nuls], "line 1 is longer than 1,048,576 characters")
    refused(["replay", "--config", nuls, "--limit", "1"], "larger than 1,048,576 bytes")
    refused(["indexer", "--file", nuls], "line 1 is longer than 1,048,576 characters")


def test_sizes_in_a_config_are_bounded(tmp_path):
    config = tmp_path / "kv.toml"
    config.write_text("block_size = 99999999999999999999\n")
    refused(["replay", "--config", str(config), "--granularity", "engine", "--limit", "1"],
            "block_size must be an integer in 1..65,536")


@pytest.mark.parametrize("url, words", [("nats://[", "Invalid IPv6 URL"),
                                        ("nats://127.0.0.1:abc", "not a number in 1..65535"),
                                        ("nats://127.0.0.1:0", "not a number in 1..65535"),
                                        ("nats://:4222", "missing host")])
def test_a_malformed_nats_url_is_one_line(url, words):
    refused(["indexer", "--nats", url], words)


@pytest.mark.parametrize("content, words", [
    ("block_size = 32\n".encode("utf-16"), "is not UTF-8 text"),
    (bytes(range(256)), "is not UTF-8 text"),
    (("a = " + "[" * 100_000 + "]" * 100_000 + "\n").encode(), "nests too deeply"),
])
def test_a_config_file_that_is_not_toml_text_is_named(tmp_path, content, words):
    config = tmp_path / "kv.toml"
    config.write_bytes(content)
    err = refused(["replay", "--config", str(config), "--limit", "1"], words)
    assert str(config) in err
