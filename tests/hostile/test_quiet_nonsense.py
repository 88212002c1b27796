"""Issue 28, item 6: what used to be accepted and ignored, or done quietly wrong, is now
refused in one line (exit 2) or counted. (Found before: ``--route prefix`` without
``--workers`` and ``--disk-dir`` without ``--data`` ignored, ``--tiers ""`` accepted, the
indexer taking ``--worker-id -1`` or 2^70, events from worker 2^70 and a block that is its
own parent applied.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstrata.events.model import StoredBlock, StoredEvent
from kvstrata.events.subscriber import StreamFollower, WorkerStates


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstrata.cli", *argv], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("argv, words", [
    (["replay", "--limit", "2", "--route", "prefix"], "--route prefix spreads requests"),
    (["replay", "--limit", "2", "--disk-dir", "/tmp"], "--disk-dir names the G3 directory"),
    (["replay", "--limit", "2", "--tiers", ""], "names no tier"),
    (["indexer", "--file", "/dev/null", "--worker-id", "-1"], "0..2^64-1"),
    (["indexer", "--file", "/dev/null", "--worker-id", str(2**70)], "0..2^64-1"),
])
def test_a_flag_that_would_be_ignored_or_is_impossible_is_refused(argv, words):
    proc = cli(*argv)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert words in line, proc.stderr


def _stored(event_id: int, parent: int | None, *hashes: int) -> StoredEvent:
    return StoredEvent(event_id, "G1", parent, 4, tuple(StoredBlock(h, h) for h in hashes))


def test_impossible_events_are_counted_not_applied():
    target = WorkerStates()
    follower = StreamFollower(target, snapshots=False)
    follower.feed(2**70, None, [_stored(1, None, 10)])             # no such worker
    follower.feed(3, None, [_stored(1, None, 10, 11), _stored(2, 11, 11),   # own parent
                            _stored(3, 11, 12, 12), _stored(4, 11, 13)])    # repeats itself
    assert follower.stats()["invalid"] == 3
    assert follower.stats()["applied"] == 2 and follower.stats()["gaps"] == 0
    assert target.hashes(3)["G1"] == {10, 11, 13}
    assert 2**70 not in target.workers
