"""The parser fuzz suite (tests/test_fuzz_parsers.py) under an address-space cap, as ``prlimit
--as`` sets one (issue 28): a parser that reads or allocates without a bound fails here
instead of taking the machine. The suite runs in a process of its own: the cap must not
reach the rest of the tests, which start engines whose address space is large."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

CAP = 4 << 30
"""Enough for the parsers and vLLM's import (the suite peaks far below it when bounded)."""


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))


def test_the_parser_fuzz_suite_passes_under_a_memory_cap():
    suite = Path(__file__).resolve().parents[1] / "test_fuzz_parsers.py"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(suite)], capture_output=True, text=True, timeout=900,
                          preexec_fn=_capped, cwd=suite.parents[1])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
