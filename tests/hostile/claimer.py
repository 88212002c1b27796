"""Run as ``python claimer.py DIR FINGERPRINT GO_FILE``: wait for GO_FILE, claim the durable
G3 home in DIR, print OK <pid> / BUSY / ERR <type> <message>, and if OK hold the
home until stdin closes."""

from __future__ import annotations

import os
import sys
import time

from kvstrata.physical import DiskStorage, LayoutConfig
from kvstrata.physical.storage.disk_home import DiskTierBusyError


def main(directory: str, fingerprint: str, go: str) -> None:
    config = LayoutConfig(num_blocks=16, num_layers=3, outer_dim=2, page_size=4, inner_dim=8,
                          dtype="bfloat16")
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    try:
        disk = DiskStorage.durable(config, directory, fingerprint=fingerprint)
    except DiskTierBusyError:
        print("BUSY", flush=True)
        return
    except BaseException as exc:       # noqa: BLE001 - reported to the test
        print(f"ERR {type(exc).__name__} {exc}", flush=True)
        return
    print(f"OK {os.getpid()}", flush=True)
    sys.stdin.read()
    disk.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
