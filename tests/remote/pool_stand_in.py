"""A pool stand-in for exporter tests that need no manager: holds hashes 1..8 at slots
10..17 (checksum hash * 1000) and records what was pinned and unpinned."""

from __future__ import annotations

import threading


class Pins:
    """``pin``/``unpin`` as a pool owner hands them to a :class:`LeaseTable`."""

    def __init__(self) -> None:
        self.pinned: list[list[int]] = []
        self.unpinned: list[list[int]] = []
        self.lock = threading.Lock()

    def pin(self, hashes):
        held = []
        for h in hashes:
            if not 1 <= h <= 8:
                break
            held.append((h, h + 9, h * 1000))
        token = [h for h, _, _ in held]
        with self.lock:
            self.pinned.append(token)
        return held, token

    def unpin(self, token):
        with self.lock:
            self.unpinned.append(token)
