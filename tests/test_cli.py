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
