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
