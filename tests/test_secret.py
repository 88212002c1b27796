"""The deployment's secret from the environment or a file: what is refused, and how."""

from __future__ import annotations

import logging
import os

import pytest

from kvstrata.secret import MAX_SECRET_BYTES, SecretError, resolve_secret


def test_a_secret_that_is_not_utf8_is_taken_as_the_bytes_the_environment_holds():
    """An undecodable byte (Python hands it over as a surrogate) raised UnicodeEncodeError."""
    value = os.fsdecode(b"\xff\xfe0123456789abcdefghij")
    assert resolve_secret(env={"KVSTRATA_SHARING_SECRET": value}) == \
        b"\xff\xfe0123456789abcdefghij"


@pytest.mark.parametrize("placeholder", ["a" * 16, "\0" * 32, "abababababababab",
                                         "abcdabcdabcdabcdab"])
def test_a_placeholder_is_no_secret(placeholder):
    with pytest.raises(SecretError, match="repeats a pattern"):
        resolve_secret(env={"KVSTRATA_SHARING_SECRET": placeholder})


def test_random_secrets_of_small_alphabets_are_never_taken_for_placeholders():
    """16 random decimal digits have few different bytes (a count of them refused a quarter)."""
    import random

    rng = random.Random(7)
    for alphabet in ("0123456789", "0123456789abcdef"):
        for _ in range(2000):
            secret = "".join(rng.choice(alphabet) for _ in range(16))
            assert resolve_secret(env={"KVSTRATA_SHARING_SECRET": secret}) == secret.encode()


def test_a_secret_file_too_long_is_refused_not_cut(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b" " + os.urandom(MAX_SECRET_BYTES))       # one byte over, before strip
    path.chmod(0o600)
    with pytest.raises(SecretError, match="longer than"):
        resolve_secret(env={"KVSTRATA_SHARING_SECRET_FILE": str(path)})


def test_a_secret_file_every_user_can_read_is_named_in_a_warning(tmp_path, caplog):
    path = tmp_path / "secret"
    path.write_text("a deployment secret of some length\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kvstrata.secret"):
        assert resolve_secret(env={"KVSTRATA_SHARING_SECRET_FILE": str(path)}) == \
            b"a deployment secret of some length"
    assert "readable by every user" in caplog.text and "a deployment secret" not in caplog.text


def test_no_repr_shows_a_secret():
    from kvstrata.kinds.base import StorageOptions
    from kvstrata.physical.storage.s3client import S3Config

    assert "S3CRET" not in repr(S3Config(access_key="key", secret_key="S3CRET-KEY"))
    assert "S3CRET" not in repr(StorageOptions(secret=b"S3CRET-DEPLOYMENT-SECRET"))


def _secret_file(directory) -> str:
    path = os.path.join(directory, "secret")
    with open(path, "w") as fh:
        fh.write("a deployment secret of some length\n")
    os.chmod(path, 0o600)
    return path


def test_a_secret_file_in_a_directory_others_can_rename_entries_in_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    path = _secret_file(shared)
    os.chmod(shared, 0o777)                      # no sticky bit: anyone may swap the file
    with pytest.raises(SecretError, match="without the sticky bit"):
        resolve_secret(env={"KVSTRATA_SHARING_SECRET_FILE": path})
    os.chmod(shared, 0o1777)                     # as /tmp: others add names, replace none
    assert resolve_secret(env={"KVSTRATA_SHARING_SECRET_FILE": path}) == \
        b"a deployment secret of some length"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_a_secret_reached_through_another_users_link_or_directory_is_refused(tmp_path):
    """Another user's link to a world-readable root file (/etc/machine-id, say) made that
    file the deployment's secret, with only a warning."""
    real = _secret_file(tmp_path)
    link = tmp_path / "link"
    os.symlink(real, link)
    os.lchown(link, 54321, 54321)                # any uid but this user's and root's
    with pytest.raises(SecretError, match="symbolic link on the way.*uid 54321"):
        resolve_secret(env={"KVSTRATA_SHARING_SECRET_FILE": str(link)})
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    inside = _secret_file(theirs)
    os.chown(theirs, 54321, 54321)
    with pytest.raises(SecretError, match="directory on the way.*uid 54321"):
        resolve_secret(env={"KVSTRATA_SHARING_SECRET_FILE": inside})
    mine = tmp_path / "mine"                      # this user's link: followed, and the
    os.symlink(real, mine)                        # file it names is checked as before
    assert resolve_secret(env={"KVSTRATA_SHARING_SECRET_FILE": str(mine)}) == \
        b"a deployment secret of some length"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_a_secret_through_a_chain_of_links_or_a_dotdot_after_a_link_is_checked_all_the_way(
        tmp_path):
    """The path is resolved as the kernel resolves it: a link of this user's to another
    user's link, or ``mine/L/../secret`` where L leads into another user's directory, was
    checked as if it named only this user's own paths."""
    real = _secret_file(tmp_path)
    theirs = tmp_path / "their_link"
    os.symlink(real, theirs)
    os.lchown(theirs, 54321, 54321)
    mine = tmp_path / "mine"
    os.symlink(theirs, mine)
    with pytest.raises(SecretError, match="their_link .a symbolic link on the way"):
        resolve_secret(env={"KVSTRATA_SHARING_SECRET_FILE": str(mine)})
    other = tmp_path / "other"
    (other / "deep").mkdir(parents=True)
    _secret_file(other)
    os.chown(other, 54321, 54321)
    me = tmp_path / "me"
    me.mkdir()
    os.symlink(other / "deep", me / "L")
    _secret_file(me)                              # what the text of the path seems to name
    with pytest.raises(SecretError, match="other .a directory on the way"):
        resolve_secret(env={"KVSTRATA_SHARING_SECRET_FILE": f"{me}/L/../secret"})
