"""Run as ``python churner.py DIR``: write blocks into a tiny durable G3 as fast as possible
(the journal is compacted every ~128 batches) until killed. Payloads are a function of the
sequence hash (tests.hostile._util.payload_of)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo: tests.hostile

from tests.hostile._util import open_durable, write   # noqa: E402


def main(directory: str) -> None:
    disk = open_durable(directory, 16)
    print("ready", flush=True)
    seq = 1 << 40
    n = 0
    while True:
        slots = [(4 * n + i) % 16 for i in range(4)]
        write(disk, slots, [seq + i for i in range(4)])
        seq += 4
        n += 1


if __name__ == "__main__":
    main(sys.argv[1])
