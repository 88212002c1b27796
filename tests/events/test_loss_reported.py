"""Issue 28, item 2: every lost event is counted and reported when the replay ends, and a
sink that lost everything makes the command fail. (Found before: ``--events
nats://127.0.0.1:1/x`` lost all 831 events with exit 0 and nothing on stderr; a JSONL sink
on a full filesystem warned of 30 dropped events when 792 were.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TIMEOUT = 180


def replay(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstrata.cli", "replay", "--limit", "20",
                           "--json", *extra], capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.parametrize("sink", ["nats://127.0.0.1:1/x", "jsonl:/dev/full"])
def test_a_sink_that_lost_everything_fails_the_command_and_says_how_many(sink):
    proc = replay("--events", sink)
    report = json.loads(proc.stdout)["events"]
    assert report["enqueued"] > 0 and report["published"] == 0
    assert report["lost"] == report["enqueued"]
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert f"{report['lost']:,} of {report['enqueued']:,} events were not delivered" in line


def test_a_sink_that_took_everything_reports_nothing_lost(tmp_path):
    target = tmp_path / "events.jsonl"
    proc = replay("--events", f"jsonl:{target}")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)["events"]
    assert report["lost"] == 0 and report["published"] == report["enqueued"] > 0
    assert len(target.read_text().splitlines()) > 0
    assert "not delivered" not in proc.stderr
