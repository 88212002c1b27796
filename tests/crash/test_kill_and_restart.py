"""kill -9 a process writing a durable G3 at random moments, restart, and check what comes back.

Each round starts :mod:`writer` (which stores blocks whose bytes are a function of their
hash), kills it with SIGKILL after a random delay (sometimes before it finished starting,
sometimes mid-write or mid-compaction), then opens the same directory in this process and
onboards every recovered block: not one block may come back with wrong bytes, the directory
must stay within its bounds, and nothing may be left behind that the next start does not
reuse.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstrata import KvBlockManager

from .writer import crash_config, payload_of

ROUNDS = 24
WRITER = Path(__file__).with_name("writer.py")


def _kill_at_random(disk_dir: Path, seed: int, rng: random.Random) -> bool:
    """Run the writer and SIGKILL it; True if it was killed after it said ready."""
    proc = subprocess.Popen([sys.executable, str(WRITER), str(disk_dir), str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if rng.random() < 0.2:                  # now and then during start-up and recovery
            time.sleep(rng.uniform(0.0, 1.5))
            ready = False
        else:
            line = proc.stdout.readline()
            assert line == b"ready\n", proc.stderr.read().decode()[-2000:]
            time.sleep(rng.uniform(0.0, 0.6))
            ready = True
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
    return ready


def _verify(disk_dir: Path) -> tuple[int, int]:
    """Onboard every recovered block; returns (blocks served, blocks dropped)."""
    served = dropped = 0
    with KvBlockManager(crash_config(), disk_dir=str(disk_dir)) as mgr:
        nbytes = mgr.storage("G1").config.block_bytes
        hashes = list(mgr.planner.registry.hashes_in("G3"))
        assert len(hashes) <= mgr.pools["G3"].capacity
        for start in range(0, len(hashes), 8):
            part = hashes[start:start + 8]
            for h in part:
                with mgr.onboard([h]).result(30) as loaded:
                    if loaded.failures:
                        assert [f.kind for f in loaded.failures] == ["checksum_mismatch"]
                        dropped += 1
                        continue
                    assert loaded.sources == ("G3",)
                    got = mgr.read_g1(loaded.block_ids)[0]
                    assert np.array_equal(got, payload_of(h, nbytes)), \
                        f"block {h:#x} came back with wrong bytes"
                    served += 1
        mgr.wait_idle(30)
    return served, dropped


@pytest.mark.slow
def test_repeated_kill_9_never_serves_a_wrong_block(tmp_path):
    rng = random.Random(20261125)
    config = crash_config()
    stride = -(-config.bytes_per_block // 4096) * 4096
    bound = config.tier_blocks("G3") * stride + 64 + 4 * 256 * 48 * 2   # slab + journal limit
    killed_ready = served_total = 0
    for round_no in range(ROUNDS):
        killed_ready += _kill_at_random(tmp_path, round_no, rng)
        served, dropped = _verify(tmp_path)
        served_total += served
        print(f"round {round_no}: served {served}, dropped {dropped}")
        homes = [p for p in tmp_path.iterdir()]
        assert len(homes) == 1 and homes[0].name.startswith("kvstrata-g3-r0-")
        names = sorted(p.name for p in homes[0].iterdir())
        assert set(names) <= {"index", "index.tmp", "lock", "slab"}, names
        used = sum(p.stat().st_blocks * 512 for p in homes[0].iterdir())
        assert used <= bound, f"round {round_no}: {used} bytes on disk, bound {bound}"
    assert killed_ready >= ROUNDS // 2                  # most kills landed mid-write
    assert served_total > 0                              # and recovery served real blocks
