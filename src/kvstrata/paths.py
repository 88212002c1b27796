"""What a path the user names must be, and reading the files it names within bounds.

Every setting that names a file or a directory (the CLI's outputs, an event sink's file, a
disk tier's directory) is checked by one of the ``*_problem`` functions when it is parsed,
so a wrong path is one line naming it at start, not an engine that dies later. Each returns
what is wrong (None if nothing is); the caller names the setting.

What kvstrata keeps at rest (a durable disk tier's home and its files) is the prompts it was
computed from, and what it reads back it serves to an engine: such a directory and its files
must be the running user's alone (:func:`make_private_directory`, :func:`check_private_file`):
a real directory or file (no symbolic link), owned by this user, writable by nobody else;
directories are created 0700 and files 0600 whatever the umask, and read access for others
found on an owned one is removed.

Files read from outside (a trace, a TOML config, an event file) are opened with
:func:`open_regular` (a regular file only: a FIFO is not waited on, a device such as
``/dev/zero`` is not read) and read with a bound: :func:`read_bounded` for a whole file,
:func:`bounded_lines` for lines, so no input makes a reader allocate without limit.

This module imports nothing from kvstrata.
"""

from __future__ import annotations

import collections
import errno
import os
import secrets
import stat
from typing import IO, BinaryIO, Iterator

__all__ = ["path_problem", "writable_file_problem", "directory_problem", "open_regular",
           "read_bounded", "bounded_lines", "write_atomically", "InputTooLargeError",
           "MAX_LINE_BYTES", "NotPrivateError", "make_private_directory", "check_private_file"]

MAX_PATH_BYTES = 4096
"""Longest path accepted (Linux's PATH_MAX)."""
MAX_LINE_BYTES = 1 << 20
"""Longest line a line reader accepts by default (1 MiB: a trace request of 60,000 blocks)."""


class NotPrivateError(PermissionError):
    """A directory or file that must be this user's alone is not: a link, another user's, or
    writable by others."""


SHARED_DIRECTORY_MODE = 0o755
"""What a missing directory kvstrata creates on the way to its own is made with, at most."""


def make_directories(path: str | os.PathLike) -> None:
    """Create ``path`` and its missing parents (an existing one is left as it is), each
    with mode 0755 at most whatever the umask: ``os.makedirs`` gives ``0777 & ~umask``, so
    under umask 0 anyone could rename or replace what is made inside them."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, SHARED_DIRECTORY_MODE)     # the umask can only take away
        except FileExistsError:
            continue


def make_private_directory(path: str | os.PathLike, *, parents: bool = True) -> None:
    """Create ``path`` (mode 0700; with ``parents``, missing parents as the umask says,
    else a missing parent is ``FileNotFoundError``) or check the existing one: a real
    directory owned by this user that neither group nor others can write
    (:class:`NotPrivateError` otherwise; what others could write may already hold anything).
    Others' read and search access is then removed."""
    path = os.fspath(path)
    if parents:
        make_directories(os.path.dirname(os.path.abspath(path)))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    # checked and changed through a descriptor of the directory itself: no link followed,
    # no swap between the check and the change (and no fchmodat(AT_SYMLINK_NOFOLLOW), which
    # glibc before 2.32 does not implement)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotPrivateError(errno.EPERM, "is not a directory (a symbolic link or "
                                  "another kind of file)", path) from None
        raise
    try:
        info = os.fstat(fd)
        problem = _not_private(info, stat.S_ISDIR, "directory")
        if problem:
            raise NotPrivateError(errno.EPERM, problem, path)
        if info.st_mode & 0o077:
            os.fchmod(fd, stat.S_IMODE(info.st_mode) & 0o700)
    finally:
        os.close(fd)


def check_private_file(fd: int, path: str | os.PathLike, *, tighten: bool = True) -> None:
    """The open file ``fd`` (named ``path`` in errors) must be a regular file owned by this
    user that neither group nor others can write (:class:`NotPrivateError` otherwise); with
    ``tighten``, its mode becomes 0600 at most."""
    info = os.fstat(fd)
    problem = _not_private(info, stat.S_ISREG, "regular file")
    if problem:
        raise NotPrivateError(errno.EPERM, problem, os.fspath(path))
    if tighten and info.st_mode & 0o077:
        os.fchmod(fd, stat.S_IMODE(info.st_mode) & 0o600)


def writer_problem(info: os.stat_result, *, root_ok: bool = False) -> str | None:
    """Why someone other than this user (or root, with ``root_ok``) could have written the
    file of status ``info`` (None if no one could): its owner, or a mode that lets its group
    or others write. The one owner-and-mode rule for what kvstrata trusts from a file; the
    caller says what follows from it."""
    owners = (os.geteuid(), 0) if root_ok else (os.geteuid(),)
    if info.st_uid not in owners:
        return (f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
                + (" or root" if root_ok else ""))
    if info.st_mode & 0o022:
        return f"is writable by its group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _not_private(info: os.stat_result, is_kind, kind: str) -> str | None:
    if not is_kind(info.st_mode):
        return f"is not a {kind} (a symbolic link or another kind of file)"
    problem = writer_problem(info)
    if problem and info.st_uid != os.geteuid():
        return f"{problem}: what another user wrote is not served"
    if problem:
        return (f"{problem}: what others could write is not served; make it the owner's alone "
                f"(chmod go-w) or use another directory")
    return None


MAX_LINKS_FOLLOWED = 40
"""Symbolic links a path may pass through (Linux's own limit: more is ``ELOOP``)."""


def redirectable_problem(path: str | os.PathLike) -> str | None:
    """Why another user could have chosen what ``path`` names (None if no one but this user
    and root could). The path is resolved as the kernel resolves it, one name at a time
    (``..`` after the link before it, every link's target in turn): every directory passed
    through and every symbolic link followed must be owned by this user or root, and a
    directory others can write must have the sticky bit (as ``/tmp``: others may add names
    there, not replace this user's). A secret read through a link another user made, or from
    a directory another user can rename entries in, is that user's choice of file. A path
    that does not resolve raises the ``OSError`` opening it would (a part missing at this
    check, present at the open, could be another user's: nothing is opened after a check
    that did not see the whole path)."""
    me = os.geteuid()

    def untrusted(where: str, info: os.stat_result, kind: str) -> str | None:
        if info.st_uid not in (me, 0):
            return (f"{where} (a {kind} on the way) is owned by uid {info.st_uid}, neither "
                    f"this user nor root")
        if kind == "directory" and info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return (f"{where} (a directory on the way) is writable by its group or others "
                    f"without the sticky bit (mode {stat.S_IMODE(info.st_mode):04o})")
        return None

    def more(names) -> bool:
        return any(n not in ("", ".") for n in names)

    text = os.fspath(path)
    if not os.path.isabs(text):
        text = os.path.join(os.getcwd(), text)
    problem = untrusted(os.sep, os.lstat(os.sep), "directory")
    if problem:
        return problem
    names = collections.deque(text.split(os.sep))
    current, links = os.sep, 0
    while names:
        name = names.popleft()
        if name in ("", "."):
            continue
        if name == "..":                       # current is resolved: its parent is real
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, name)
        info = os.lstat(candidate)               # a missing part: FileNotFoundError
        if stat.S_ISLNK(info.st_mode):
            problem = untrusted(candidate, info, "symbolic link")
            if problem:
                return problem
            links += 1
            if links > MAX_LINKS_FOLLOWED:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), text)
            target = os.readlink(candidate)
            if os.path.isabs(target):
                current = os.sep
            names.extendleft(reversed(target.split(os.sep)))
            continue
        if more(names):                        # a directory to pass through
            if not stat.S_ISDIR(info.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), candidate)
            problem = untrusted(candidate, info, "directory")
            if problem:
                return problem
        current = candidate
    return None


class InputTooLargeError(ValueError):
    """A file or a line is larger than the bound its reader accepts."""


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


def writable_file_problem(path: str | os.PathLike, *, regular: bool = False) -> str | None:
    """Whether a file can be created or appended to at ``path``: its directory exists, it is
    not a directory (with ``regular``, nothing but a regular file), and this process may
    write it."""
    problem = path_problem(path)
    if problem:
        return problem
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"directory {directory} does not exist"
    if os.path.isdir(path):
        return "is a directory"
    if regular and os.path.exists(path) and not os.path.isfile(path):
        return "is not a regular file"
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


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for reading in binary, if it is a regular file (or ``/dev/null``, which
    is empty); else ``OSError`` (a FIFO is refused without waiting for a writer, any other
    device without reading it)."""
    problem = path_problem(path)
    if problem:
        raise OSError(errno.EINVAL, f"the path {problem}", os.fspath(path)
                      if isinstance(path, (str, os.PathLike)) else repr(path))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) and not os.path.samefile(path, os.devnull):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path``; :class:`InputTooLargeError` if it holds more
    than ``limit`` (nothing more than ``limit + 1`` bytes is read)."""
    with open_regular(path) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise InputTooLargeError(f"{os.fspath(path)} is larger than {limit:,} bytes")
    return data


def bounded_lines(fh: IO, limit: int = MAX_LINE_BYTES) -> Iterator:
    """The lines of ``fh`` (text or binary), each at most ``limit`` long;
    :class:`InputTooLargeError` naming the line number past that (no longer line is held)."""
    number = 0
    while True:
        line = fh.readline(limit + 2)           # the line, its newline, and one more
        if not line:
            return
        number += 1
        content = len(line) - (line[-1:] in ("\n", b"\n"))
        if content > limit:
            raise InputTooLargeError(f"line {number} is longer than {limit:,} characters")
        yield line


def _temp_beside(path: str) -> str:
    """The name of the new file :func:`write_atomically` writes first, beside ``path``."""
    return f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def atomic_write_problem(path: str | os.PathLike) -> str | None:
    """What would stop :func:`write_atomically` from writing ``path`` (a file name too long
    once its temporary suffix is added, a filesystem that takes no new files), found by
    creating and removing the very kind of file it writes first; None if nothing. For
    checking an output before the work that produces it."""
    problem = writable_file_problem(path, regular=True)
    if problem:
        return problem
    temp = _temp_beside(os.fspath(path))
    try:
        os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600))
    except OSError as exc:
        return f"cannot be written there ({exc.strerror or exc})"
    os.unlink(temp)
    return None


def write_all(fd: int, data) -> None:
    """Write all of ``data`` at ``fd``'s offset, continuing after short writes; a write that
    makes no progress is ``OSError(EIO)`` rather than a loop without end."""
    view = memoryview(data)
    while view:
        done = os.write(fd, view)
        if done <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[done:]


def write_atomically(path: str | os.PathLike, data: bytes, *, exclusive: bool = False,
                     mode: int = 0o666) -> tuple[int, int]:
    """Write ``data`` as the file ``path``: into a new file beside it (``mode``, less the
    umask; never through a symbolic link), flushed, then renamed over it, or with
    ``exclusive`` linked under it only if no ``path`` exists yet (:class:`FileExistsError`
    otherwise). A failure (a full filesystem) leaves ``path`` as it was and nothing else.
    Returns the (device, inode) of the file written."""
    path = os.fspath(path)
    temp = _temp_beside(path)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode)
    try:
        with open(fd, "wb", closefd=False) as fh:
            fh.write(data)
            fh.flush()
        os.fsync(fd)
        st = os.fstat(fd)
        if exclusive:
            os.link(temp, path)
            os.unlink(temp)
        else:
            os.replace(temp, path)
        return st.st_dev, st.st_ino
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    finally:
        os.close(fd)
