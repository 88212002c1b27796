"""A durable disk tier is its user's alone (issue 27, findings 3 and 4): a home another user
made (a real second OS user, created here when the tests run as root), a symbolic link, or a
home others can write is refused with the reason; files are 0600 and the home 0700 whatever
the umask; what an owned home or file lets others read is taken back."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile

import pytest

from kvstrata.physical import DiskStorage, LayoutConfig, StorageConfigError
from kvstrata.physical.storage.disk_home import home_name

FP = "0123456789abcdef"
CONFIG = LayoutConfig(num_blocks=4, num_layers=1, outer_dim=2, page_size=4, inner_dim=8,
                      dtype="float16")


def durable(directory) -> DiskStorage:
    return DiskStorage.durable(CONFIG, directory, fingerprint=FP, o_direct=False)


def home_of(directory) -> str:
    return os.path.join(directory, home_name("g3", 0, FP))


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def as_user(user, command: str) -> None:
    """Run the shell ``command`` as ``user`` (setpriv: that uid and gid, no other groups)."""
    subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                    "--clear-groups", "sh", "-c", command], check=True, timeout=60)


@pytest.fixture
def shared_dir():
    """A world-writable directory (sticky, as /tmp) both users reach (pytest's own temporary
    directories are private to the user running the tests)."""
    path = tempfile.mkdtemp(prefix="kvstrata-shared-", dir="/tmp")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_home_another_user_made_in_a_shared_directory_is_refused(shared_dir, other_user):
    """Finding 3: in a world-writable directory, another user pre-creates the home with a
    0666 slab; the owner's server used it (the other user then read its blocks and replaced
    one). Now it is refused, naming the owner, and nothing of it is opened or removed."""
    home = home_of(shared_dir)
    as_user(other_user, f"umask 0 && mkdir -m 777 '{home}' && printf AAAAAAAA > '{home}/slab'"
                        f" && chmod 666 '{home}/slab'")
    with pytest.raises(StorageConfigError, match=f"owned by uid {other_user.pw_uid}"):
        durable(shared_dir)
    assert os.lstat(home).st_uid == other_user.pw_uid
    assert os.listdir(home) == ["slab"]


def test_a_file_of_another_user_in_an_owned_home_is_refused(tmp_path, other_user):
    storage = durable(tmp_path)
    storage.close()
    slab = os.path.join(home_of(tmp_path), "slab")
    os.chown(slab, other_user.pw_uid, other_user.pw_gid)
    with pytest.raises(StorageConfigError, match="slab is owned by uid"):
        durable(tmp_path)


def test_a_symlinked_home_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "d").mkdir()
    os.symlink(elsewhere, home_of(tmp_path / "d"))
    with pytest.raises(StorageConfigError, match="symbolic link"):
        durable(tmp_path / "d")
    assert os.listdir(elsewhere) == []


def test_a_home_others_can_write_is_refused(tmp_path):
    """A home made with umask 000 by an older version (0777): anyone could have replaced its
    slab or index; it is refused until its owner makes it private."""
    os.mkdir(home_of(tmp_path))
    os.chmod(home_of(tmp_path), 0o777)
    with pytest.raises(StorageConfigError, match="writable by its group or others"):
        durable(tmp_path)
    os.chmod(home_of(tmp_path), 0o700)
    durable(tmp_path).close()


def test_with_umask_000_the_home_is_0700_and_its_files_0600(tmp_path):
    """Finding 4: the index was 0644 (every block hash and checksum readable by anyone)."""
    old = os.umask(0)
    try:
        storage = durable(tmp_path)
        try:
            home = home_of(tmp_path)
            assert mode(home) == 0o700
            for name in os.listdir(home):
                assert mode(os.path.join(home, name)) == 0o600, name
            assert {"lock", "slab"} <= set(os.listdir(home))
        finally:
            storage.close()
        for name in os.listdir(home):            # the index is rewritten at close
            assert mode(os.path.join(home, name)) == 0o600, name
    finally:
        os.umask(old)


def test_an_owned_home_and_files_others_can_read_are_made_private(tmp_path):
    storage = durable(tmp_path)
    storage.close()
    home = home_of(tmp_path)
    os.chmod(home, 0o755)
    for name in os.listdir(home):
        os.chmod(os.path.join(home, name), 0o644)
    durable(tmp_path).close()
    assert mode(home) == 0o700
    assert {mode(os.path.join(home, n)) for n in os.listdir(home)} == {0o600}


def test_no_stale_home_is_removed_in_a_directory_another_user_owns(shared_dir, other_user):
    """The owner of the directory may rename what is in it, sticky bit or not: a home there
    under a stale name may be this model's own, renamed, so none is removed."""
    parent = os.path.join(shared_dir, "owned-by-other")
    os.mkdir(parent, 0o755)
    os.chown(parent, other_user.pw_uid, other_user.pw_gid)
    disk = durable(parent)
    disk.close()
    stale = os.path.join(parent, "kvstrata-g3-r0-0000000000000000")
    os.rename(home_of(parent), stale)               # as the owner of `parent` could
    disk = durable(parent)
    disk.close()
    assert os.path.isdir(stale)
