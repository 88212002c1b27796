"""kill -9 a process churning a tiny durable G3 (its journal compacted many times a second),
then recover: no leftover temp journal, bounded files, and every recovered block serves its
exact bytes or is refused."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvstrata.physical.storage.disk_index import RECORD_BYTES

from ._util import home_of, open_durable, read_ok

CHURNER = Path(__file__).with_name("churner.py")
ROUNDS = 5


def test_kill_9_during_compaction_leaves_nothing_behind_and_no_wrong_bytes(tmp_path):
    rng = random.Random(7)
    home = home_of(tmp_path)
    served_total = 0
    for _ in range(ROUNDS):
        proc = subprocess.Popen([sys.executable, str(CHURNER), str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = proc.stdout.readline()
            assert line == b"ready\n", proc.stderr.read().decode()[-2000:]
            time.sleep(rng.uniform(0.05, 0.5))
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            proc.stdout.close()
            proc.stderr.close()
        names = {p.name for p in home.iterdir()}
        assert names <= {"index", "index.tmp", "lock", "slab"}, names
        disk = open_durable(tmp_path, 16)
        try:
            stride = disk.layout.block_stride
            assert {p.name for p in home.iterdir()} == {"index", "lock", "slab"}
            assert os.path.getsize(home / "slab") == 16 * stride
            assert (home / "index").stat().st_size <= 64 + 16 * RECORD_BYTES
            served = sum(read_ok(disk, e.slot, e.sequence_hash) for e in disk.recovered)
            # a kill only loses the batch in flight (freed before its bytes changed): every
            # entry recovered names bytes that fully landed
            assert served == len(disk.recovered) > 0
            served_total += served
        finally:
            disk.close()
    assert served_total > 0
    assert [p.name for p in tmp_path.iterdir()] == [home.name]
