import json
import subprocess
import sys

import pytest

from kvstrata.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_hash_command_prints_reference_vector(capsys):
    code, out, _ = run(capsys, "hash", "--block-size", "4", *map(str, range(1, 11)))
    assert code == 0
    assert json.loads(out) == {
        "block_size": 4,
        "local_hashes": [14643705804678351452, 16777012769546811212],
        "sequence_hashes": [14643705804678351452, 4945711292740353085],
    }


def test_hash_command_salt_changes_hashes(capsys):
    _, plain, _ = run(capsys, "hash", "--block-size", "2", "1", "2")
    _, salted, _ = run(capsys, "hash", "--block-size", "2", "--salt", "t1", "1", "2")
    assert json.loads(plain)["sequence_hashes"] != json.loads(salted)["sequence_hashes"]


def test_hash_command_rejects_bad_tokens(capsys):
    code, _, err = run(capsys, "hash", "--block-size", "2", "1", "-3")
    assert code == 2 and "token" in err


def small_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [{"timestamp": i, "input_length": 2000, "output_length": 5, "hash_ids": [0, 1, 2, 3 + i % 3]}
             for i in range(30)]
    path.write_text("\n".join(json.dumps(l) for l in lines) + "\n")
    return path


def test_replay_json_has_the_documented_keys(capsys, tmp_path):
    code, out, _ = run(capsys, "replay", str(small_trace(tmp_path)), "--granularity", "trace",
                       "--tiers", "G1=3", "--policy", "lru", "--json")
    doc = json.loads(out)
    assert code == 0
    g1 = doc["tiers"]["G1"]
    assert {"blocks_looked_up", "blocks_hit", "tokens_hit"} <= set(g1)
    assert g1["blocks_looked_up"] == 120 and g1["capacity"] == 3


def test_replay_table_and_plot(capsys, tmp_path):
    png = tmp_path / "hit.png"
    code, out, _ = run(capsys, "replay", str(small_trace(tmp_path)), "--tiers", "G1=64,G2=256",
                       "--plot", str(png))
    assert code == 0 and "G2" in out and "hit %" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_malformed_trace_exit_code(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_length": 1, "hash_ids": [1]}\n[1, 2]\n')
    code, _, err = run(capsys, "replay", str(bad))
    assert code == 2 and "bad.jsonl:2" in err


def test_replay_bad_config_names_problems(capsys, tmp_path):
    code, _, err = run(capsys, "replay", str(small_trace(tmp_path)), "--tiers", "G1=0,G7=4",
                       "--policy", "nope")
    assert code == 2
    assert "G7" in err and "nope" in err and "G1" in err


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "kvstrata.cli", "hash", "--block-size", "1", "5"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["block_size"] == 1


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--block-size", "32"], "--block-size applies"),
        (["--limit", "0"], "--limit must be"),
        (["--limit", "-5"], "--limit must be"),
        (["--tiers", "G1=1MiB"], "hold no block"),
    ],
)
def test_replay_flag_errors_exit_2(capsys, tmp_path, extra, message):
    code, _, err = run(capsys, "replay", str(small_trace(tmp_path)), *extra)
    assert code == 2 and message in err


@pytest.mark.parametrize(
    "content",
    [b"\x89PNG\r\n\x1a\n\xff\xfe\x00binary", b'{"input_length": NaN, "hash_ids": [1]}\n',
     b'{"input_length": Infinity, "hash_ids": [1]}\n'],
)
def test_replay_unreadable_traces_exit_2(capsys, tmp_path, content):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    code, _, err = run(capsys, "replay", str(bad))
    assert code == 2 and "bad.jsonl" in err


def test_corrupt_gzip_trace_exit_2(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    code, _, err = run(capsys, "replay", str(bad))
    assert code == 2 and "cannot read trace" in err


def test_policy_flag_overrides_per_tier_policies_from_a_file(capsys, tmp_path):
    cfg = tmp_path / "kv.toml"
    cfg.write_text('[tiers.G1]\nblocks = 3\neviction = "lfu"\nadmission = "second-offer"\n')
    code, out, _ = run(capsys, "replay", str(small_trace(tmp_path)), "--config", str(cfg),
                       "--policy", "lru", "--admission", "always", "--json")
    g1 = json.loads(out)["tiers"]["G1"]
    assert code == 0 and (g1["eviction"], g1["admission"]) == ("lru", "always")



def test_admission_flag_sets_the_bottom_tiers_filter_and_keeps_the_others(capsys, tmp_path):
    """The global filter is the bottom tier's: the flag overrides the bottom tier's own
    choice from a file, while a filter a file gave a tier above stays."""
    cfg = tmp_path / "kv.toml"
    cfg.write_text('[tiers.G1]\nblocks = 3\n[tiers.G2]\nblocks = 6\nadmission = "second-offer"\n'
                   '[tiers.G3]\nblocks = 12\nadmission = "always"\n')
    code, out, _ = run(capsys, "replay", str(small_trace(tmp_path)), "--config", str(cfg),
                       "--admission", "adaptive", "--json")
    tiers = json.loads(out)["tiers"]
    assert code == 0
    assert [tiers[t]["admission"] for t in ("G1", "G2", "G3")] == \
        ["always", "second-offer", "adaptive"]

# -- every input error: one line on stderr naming the input, exit 2, no traceback -----------

def _cli(*argv, stdin=None, env=None):
    """Run the real command in a subprocess (tracebacks and exit codes as a user sees them)."""
    import os

    proc = subprocess.run([sys.executable, "-m", "kvstrata.cli", *argv], capture_output=True,
                          input=stdin, timeout=120, env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr.decode("utf-8", "replace")


def assert_one_line_error(code, err, *words):
    lines = [l for l in err.splitlines() if l.strip() and "Triton" not in l]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("argv, words", [
    (["replay", "--limit", "3", "--events", "bogus"], ["sink spec", "bogus"]),
    (["replay", "--limit", "3", "--events", "jsonl:/missing/dir/x"], ["/missing/dir"]),
    (["replay", "--limit", "3", "--events", "nats://127.0.0.1:abc/x"], ["port"]),
    (["replay", "--limit", "3", "--plot", "/nonexistent-dir/x.png"], ["--plot", "/nonexistent-dir"]),
    (["replay", "--limit", "3", "--plot", "/"], ["--plot", "directory"]),
    (["replay", "--tiers", "G1=zz"], ["G1"]),
    (["replay", "--no-such-flag"], ["--no-such-flag"]),
    (["hash", "--block-size", "0", "1"], ["block"]),
    (["indexer", "--file", "/nonexistent.jsonl"], ["--file", "/nonexistent.jsonl"]),
    (["indexer", "--file", "/dev/null", "--http", "127.0.0.1:99999"], ["--http", "99999"]),
    (["replay", "--data", "--limit", "2", "--events", "none"], ["--events", "--data"]),
    (["replay", "--data", "--limit", "2", "--plot", "x.png"], ["--plot", "--data"]),
    (["replay", "--data", "--limit", "2", "--prefill-rate", "inf"], ["--prefill-rate"]),
    (["replay", "--data", "--limit", "2", "--prefill-rate", "1e-308"], ["--prefill-rate"]),
    (["replay", "", "--limit", "3"], ["trace path is empty"]),
    (["replay", "--limit", "3", "--plot", ""], ["--plot is empty"]),
    (["replay", "--limit", "3", "--events", ""], ["--events is empty"]),
    (["replay", "--limit", "3", "--config", ""], ["--config is empty"]),
    (["replay", "--limit", "3", "--plot", "c" * 250 + ".png"], ["--plot", "cannot be written"]),
])
def test_input_errors_are_one_line_and_exit_2(argv, words):
    code, _, err = _cli(*argv)
    assert_one_line_error(code, err, *words)


def _trace_file(path, lines: list[str], encoding="utf-8", prefix=b"") -> str:
    path.write_bytes(prefix + "".join(lines).encode(encoding, "surrogateescape"))
    return str(path)


def test_an_output_that_is_the_trace_itself_is_refused(tmp_path):
    line = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
    trace = _trace_file(tmp_path / "t.jsonl", [line] * 3)
    before = (tmp_path / "t.jsonl").read_bytes()
    for flag, value in (("--plot", trace), ("--events", f"jsonl:{trace}")):
        code, _, err = _cli("replay", trace, flag, value)
        assert_one_line_error(code, err, flag, "is the trace being replayed")
    assert (tmp_path / "t.jsonl").read_bytes() == before


def test_trace_lines_are_read_as_utf8_json_lines_and_errors_name_their_line(tmp_path):
    good = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
    # a BOM, a carriage return inside a line (JSON whitespace), CRLF endings: all read
    trace = _trace_file(tmp_path / "ok.jsonl", [good, good.replace(", ", ",\r "),
                                               good.replace("\n", "\r\n")],
                        prefix=b"\xef\xbb\xbf")
    code, out, err = _cli("replay", trace, "--json")
    assert code == 0 and json.loads(out)["requests"] == 3, err
    trace = _trace_file(tmp_path / "latin1.jsonl", [good] * 4000 + ['{"x": "caf\udce9"}\n'])
    code, _, err = _cli("replay", trace)
    assert_one_line_error(code, err, "latin1.jsonl:4001", "not UTF-8")
    short = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}\n'
    code, out, err = _cli("replay", _trace_file(tmp_path / "short.jsonl", [short] * 2), "--json")
    report = json.loads(out)                    # the ids say more tokens than the prompt has
    assert code == 0 and report["tokens"] == 1200 and report["blocks"] == 6, err
    code, _, err = _cli("replay", _trace_file(tmp_path / "frac.jsonl",
                                              [good.replace("600", "600.5")]))
    assert_one_line_error(code, err, "frac.jsonl:1", "whole number")


def test_a_request_too_many_blocks_at_engine_granularity_is_refused_before_the_replay(tmp_path):
    ids = list(range(4096))
    line = json.dumps({"timestamp": 0, "input_length": 4096 * 512, "output_length": 1,
                       "hash_ids": ids}) + "\n"
    trace = _trace_file(tmp_path / "long.jsonl", [line])
    code, _, err = _cli("replay", trace, "--granularity", "engine", "--block-size", "1")
    assert_one_line_error(code, err, "request 1", "2,097,152 blocks", "--block-size")


def test_binary_files_are_named_not_traced(tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 8)
    code, _, err = _cli("indexer", "--file", str(blob))
    assert_one_line_error(code, err, str(blob))
    code, _, err = _cli("replay", str(blob))
    assert_one_line_error(code, err, str(blob))


def test_non_utf8_salt_and_lora_are_refused(tmp_path):
    import os

    for flag in ("--lora", "--salt"):
        proc = subprocess.run([sys.executable, "-m", "kvstrata.cli", "hash", "--block-size",
                               "2", flag.encode(), b"a\xffb", b"1", b"2"],
                              capture_output=True, timeout=60, env=dict(os.environ))
        assert_one_line_error(proc.returncode, proc.stderr.decode(), flag, "UTF-8")


def test_a_busy_port_is_one_line():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = _cli("indexer", "--file", "/dev/null", "--http", f"127.0.0.1:{port}")
    assert_one_line_error(code, err, "--http", str(port))


def test_a_closed_pipe_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata.cli", "hash", "--block-size", "1",
                             *map(str, range(1, 30_000))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(10)
    proc.stdout.close()                       # the reader goes away, like `| head -c 10`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_errors_that_need_no_work_come_before_the_work(tmp_path):
    """A bad --plot path fails at once, not after replaying the whole trace."""
    import time

    start = time.monotonic()
    code, out, err = _cli("replay", "--plot", "/nonexistent-dir/x.png")
    assert code == 2 and not out
    assert time.monotonic() - start < 60


def test_a_tier_whose_slots_cannot_be_reserved_is_one_line_not_a_traceback():
    """Within the slot limit, a pool still reserves address space for every slot up front;
    where the host refuses it (here: an address-space limit on the process), the command
    says so in one line."""
    import resource

    def limit_address_space():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    proc = subprocess.run([sys.executable, "-m", "kvstrata.cli", "replay", "--limit", "3",
                           "--tiers", "G1=2000000000"], capture_output=True, timeout=120,
                          preexec_fn=limit_address_space)
    assert_one_line_error(proc.returncode, proc.stderr.decode("utf-8", "replace"),
                          "cannot reserve 2,000,000,000 slots", "make the tier smaller")


def test_outputs_that_could_hang_or_destroy_are_refused_and_a_failed_run_publishes_nothing(
        tmp_path):
    """An event file that is a FIFO nobody reads is refused (its open waited for ever); a
    zmq ipc endpoint on an existing file is refused (ZMQ replaced the file with its socket),
    and the socket a run binds is gone after it; a run that fails on its trace creates no
    event file."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_one_line_error(*_cli("replay", "--limit", "3", "--events", f"jsonl:{fifo}")[::2],
                          "FIFO")
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    assert_one_line_error(*_cli("replay", "--limit", "3", "--events",
                                f"zmq://ipc://{precious}")[::2], "not a socket")
    assert precious.read_text() == "keep me"
    sock = tmp_path / "events.ipc"
    code, _, err = _cli("replay", "--limit", "3", "--events", f"zmq://ipc://{sock}")
    assert code == 0, err
    assert not sock.exists()
    events = tmp_path / "events.jsonl"
    assert_one_line_error(*_cli("replay", str(tmp_path / "missing.jsonl"), "--events",
                                f"jsonl:{events}")[::2], "missing.jsonl")
    assert not events.exists()


@pytest.mark.parametrize("argv, words", [
    (["replay", "--limit", "1" + "0" * 26], ["--limit"]),
    (["hash", "--block-size", "1" + "0" * 23, "1"], ["block_size", "65,536"]),
    (["replay", "--limit", "2", "--events", "zmq://tcp://127.0.0.1:5999?hwm=" + "1" * 24],
     ["hwm", "9 digits"]),
])
def test_numbers_beyond_any_use_are_named_plainly(argv, words):
    code, _, err = _cli(*argv)
    assert_one_line_error(code, err, *words)
    assert len(err) < 400


def test_a_config_error_line_is_cut(tmp_path):
    config = tmp_path / "big.toml"
    config.write_text(f'eviction = "{"x" * 5000}"\n')
    code, _, err = _cli("replay", "--config", str(config))
    assert_one_line_error(code, err, "invalid config")
    assert len(err) < 2100


def test_the_indexer_server_stopped_by_sigterm_says_so_and_exits_143(tmp_path):
    import signal

    events = tmp_path / "events.jsonl"
    events.write_text("")
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata.cli", "indexer", "--file",
                             str(events), "--http", "127.0.0.1:0"], stderr=subprocess.PIPE)
    try:
        line = proc.stderr.readline().decode()        # readiness: it says where it serves
        assert "serving http://127.0.0.1:" in line, line
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert "terminated" in err.decode() and "Traceback" not in err.decode()


def test_trusted_worker_ids_are_u64():
    code, _, err = _cli("indexer", "--file", "/dev/null", "--trust-workers", str(1 << 64))
    assert_one_line_error(code, err, "--trust-workers", "2^64")
