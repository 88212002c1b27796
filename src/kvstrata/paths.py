"""What a path the user names must be, checked before anything is written there.

Every setting that names a file or a directory (the CLI's outputs, an event sink's file, a
disk tier's directory) is checked by one of these when it is parsed, so a wrong path is one
line naming it at start, not an engine that dies later. Each returns what is wrong (None if
nothing is); the caller names the setting.

This module imports nothing from kvstrata.
"""

from __future__ import annotations

import os

__all__ = ["path_problem", "writable_file_problem", "directory_problem"]

MAX_PATH_BYTES = 4096
"""Longest path accepted (Linux's PATH_MAX)."""


def path_problem(path: object) -> str | None:
    """Whether ``path`` can name a file at all: a string or ``os.PathLike``, not empty, no NUL
    byte, at most :data:`MAX_PATH_BYTES`."""
    if not isinstance(path, (str, os.PathLike)):
        return f"is not a path: {path!r:.80}"
    try:
        text = os.fsdecode(os.fspath(path))
    except (TypeError, ValueError):
        return f"is not a path: {path!r:.80}"
    if not text:
        return "is empty"
    if "\0" in text:
        return "contains a NUL byte"
    if len(text.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        return f"is longer than {MAX_PATH_BYTES} bytes"
    return None


def writable_file_problem(path: str | os.PathLike) -> str | None:
    """Whether a file can be created or appended to at ``path``: its directory exists, it is
    not a directory, and this process may write it."""
    problem = path_problem(path)
    if problem:
        return problem
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"directory {directory} does not exist"
    if os.path.isdir(path):
        return "is a directory"
    target = path if os.path.exists(path) else directory
    if not os.access(target, os.W_OK):
        return "not writable"
    return None


def directory_problem(path: str | os.PathLike) -> str | None:
    """Whether ``path`` is, or can be made, a directory this process writes in: an existing
    writable directory, or a path whose nearest existing ancestor is one."""
    problem = path_problem(path)
    if problem:
        return problem
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "not writable"
    parent = path
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None
