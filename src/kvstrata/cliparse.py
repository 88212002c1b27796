"""The argument parser of every ``kvstrata`` command: errors are one line and exit 2."""

from __future__ import annotations

import argparse

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: message``) and exit status 2;
    ``-h`` still prints the full usage."""

    def error(self, message: str) -> None:   # type: ignore[override]
        self.exit(2, f"{self.prog}: {message}\n")
