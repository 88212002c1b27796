"""kvstrata.paths: the rules for paths the user names, and bounded reads and whole writes of
the files they name."""

from __future__ import annotations

import errno
import io
import os

import pytest

from kvstrata import paths


def test_path_problems():
    assert paths.path_problem("/tmp/x") is None
    assert paths.path_problem("") == "is empty"
    assert paths.path_problem("/tmp/a\0b") == "contains a NUL byte"
    assert paths.path_problem("x" * 5000).startswith("is longer than")
    assert paths.path_problem(7).startswith("is not a path")


def test_writable_files_and_directories(tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    assert paths.writable_file_problem(tmp_path / "new") is None
    assert paths.writable_file_problem(tmp_path) == "is a directory"
    assert paths.writable_file_problem(tmp_path / "no" / "x").startswith("directory ")
    assert paths.writable_file_problem("/dev/null") is None
    assert paths.writable_file_problem("/dev/null", regular=True) == "is not a regular file"
    assert paths.directory_problem(tmp_path / "a" / "b") is None          # can be made
    assert paths.directory_problem(afile) == "is not a directory"
    assert paths.directory_problem(afile / "sub").endswith("is not a directory")


def test_only_regular_files_are_opened(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero", tmp_path):
        with pytest.raises(OSError):
            paths.open_regular(path)
    with paths.open_regular("/dev/null") as fh:                           # empty, allowed
        assert fh.read() == b""


def test_reads_are_bounded(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"a" * 101)
    with pytest.raises(paths.InputTooLargeError):
        paths.read_bounded(big, 100)
    assert paths.read_bounded(big, 101) == b"a" * 101
    assert list(paths.bounded_lines(io.StringIO("abc\nde\n"), 3)) == ["abc\n", "de\n"]
    with pytest.raises(paths.InputTooLargeError, match="line 2"):
        list(paths.bounded_lines(io.BytesIO(b"ab\nabcd"), 3))


def test_a_failed_whole_write_leaves_the_old_file_and_nothing_else(tmp_path, monkeypatch):
    target = tmp_path / "plot.png"
    target.write_bytes(b"old")
    paths.write_atomically(target, b"new")
    assert target.read_bytes() == b"new"

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        paths.write_atomically(target, b"newer")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


def test_directories_made_on_the_way_are_never_writable_by_others_whatever_the_umask(tmp_path):
    """Missing parents are made 0755 at most: under umask 0, ``os.makedirs`` made them 0777,
    and anyone could rename or replace what kvstrata then kept inside."""
    import subprocess
    import sys

    target = tmp_path / "a" / "b" / "home"
    code = ("import os, sys; os.umask(0); from kvstrata.paths import make_private_directory; "
            "make_private_directory(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(target)], check=True)
    for made in (tmp_path / "a", tmp_path / "a" / "b"):
        assert made.stat().st_mode & 0o777 == 0o755
    assert target.stat().st_mode & 0o777 == 0o700
    code = ("import os, sys; os.umask(0o077); from kvstrata.paths import make_directories; "
            "make_directories(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c" / "d")], check=True)
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700     # a stricter umask still holds


def test_write_all_completes_short_writes_and_fails_one_that_makes_no_progress(tmp_path,
                                                                               monkeypatch):
    from kvstrata.paths import write_all

    real_write = os.write
    answers = iter([3, 0])

    def short_then_stalled(fd, data):
        n = next(answers)
        return real_write(fd, bytes(data[:n])) if n else 0

    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        monkeypatch.setattr(os, "write", short_then_stalled)
        with pytest.raises(OSError) as info:
            write_all(fd, b"abcdefgh")
        assert info.value.errno == errno.EIO
        monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:2])))
        write_all(fd, b"ijklmn")
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"abcijklmn"


def test_a_path_that_does_not_resolve_is_an_error_not_a_pass(tmp_path):
    """A part missing when the path was checked could be another user's when it is opened
    (renamed into place between the two): the check raises as the open would."""
    from kvstrata.paths import redirectable_problem

    with pytest.raises(FileNotFoundError):
        redirectable_problem(tmp_path / "missing" / "secret")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        redirectable_problem(tmp_path / "file" / "secret")
    os.symlink("loop", tmp_path / "loop")
    with pytest.raises(OSError):
        redirectable_problem(tmp_path / "loop" / "secret")
    assert redirectable_problem(tmp_path / "file") is None
