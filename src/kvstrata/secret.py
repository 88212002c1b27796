"""The deployment's secret: where a process finds it, and the keys derived from it.

One secret serves every purpose that needs one; each purpose gets its own key derived from
it (:func:`derive_key`, BLAKE3's key derivation with a fixed context string), so a key
learnt from one use says nothing of another. Today: proving to a peer that one belongs to the
deployment (:mod:`kvstrata.remote.auth`, HMAC over the secret itself) and tagging blocks
stored at rest (:mod:`kvstrata.physical.tags`).

The secret (at least :data:`MIN_SECRET_BYTES`; make it random, ``openssl rand -hex 32``)
comes from the caller, else from ``$KVSTRATA_SHARING_SECRET`` (named for its first use,
sharing G2 between engines), else from the file ``$KVSTRATA_SHARING_SECRET_FILE`` (a regular
file, links followed as Kubernetes mounts its secrets, owned by the running user or root and
writable by no one else). Not from a command line or a JSON config: those show in process
listings.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Mapping

__all__ = ["SECRET_ENV", "SECRET_FILE_ENV", "MIN_SECRET_BYTES", "MAX_SECRET_BYTES",
           "SecretError", "resolve_secret", "derive_key"]

SECRET_ENV = "KVSTRATA_SHARING_SECRET"
SECRET_FILE_ENV = "KVSTRATA_SHARING_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
PLACEHOLDER_PERIOD = 4
"""A secret that is one pattern of at most this many bytes repeated (``"a" * 16``, zeros,
``"abab..."``) is refused: a placeholder, not a secret. A random secret of 16 bytes or more,
in any alphabet (hex, decimal digits), is such a repetition with a chance of 10^-12 at most."""

log = logging.getLogger(__name__)


class SecretError(ValueError):
    """The deployment's secret is set but unusable (too short, too long, a file others can
    write or that cannot be read)."""


def resolve_secret(secret: bytes | str | None = None,
                   env: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment's secret: ``secret`` if given, else ``$KVSTRATA_SHARING_SECRET``, else
    the contents of ``$KVSTRATA_SHARING_SECRET_FILE``; None when none is set.
    :class:`SecretError` when the one given is shorter than :data:`MIN_SECRET_BYTES` or its
    file is not private."""
    env = os.environ if env is None else env
    source = "the secret given"
    if secret is None and env.get(SECRET_ENV):
        secret, source = env[SECRET_ENV], f"${SECRET_ENV}"
    elif secret is None and env.get(SECRET_FILE_ENV):
        secret, source = _read_secret_file(env[SECRET_FILE_ENV]), f"${SECRET_FILE_ENV}"
    if secret is None:
        return None
    if isinstance(secret, str):
        # the bytes the environment holds, whatever their encoding (an undecodable byte is
        # kept as it came, not an encoding error)
        secret = os.fsencode(secret.strip())
    if not isinstance(secret, bytes) or not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise SecretError(f"{source}: a deployment secret is {MIN_SECRET_BYTES} to "
                          f"{MAX_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32`)")
    if any(secret == secret[:period] * (len(secret) // period) + secret[:len(secret) % period]
           for period in range(1, PLACEHOLDER_PERIOD + 1)):
        raise SecretError(f"{source}: a deployment secret that repeats a pattern of "
                          f"{PLACEHOLDER_PERIOD} bytes or fewer is no secret (e.g. "
                          f"`openssl rand -hex 32`)")
    return secret


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A 32-byte key for ``purpose`` (a fixed, versioned context string such as
    ``"kvstrata 2026-11 stored block tags"``) derived from ``secret``."""
    import blake3

    return blake3.blake3(secret, derive_key_context=purpose).digest(32)


def _read_secret_file(path: str) -> bytes:
    from .paths import redirectable_problem, writer_problem

    try:
        problem = redirectable_problem(path)
    except OSError as exc:
        raise SecretError(f"${SECRET_FILE_ENV}: cannot open {path}: "
                          f"{exc.strerror or exc}") from None
    if problem:
        raise SecretError(f"${SECRET_FILE_ENV}: {path}: {problem}: another user could have "
                          f"chosen this file; name one on a path only you (or root) control")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise SecretError(f"${SECRET_FILE_ENV}: cannot open {path}: "
                          f"{exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SecretError(f"${SECRET_FILE_ENV}: {path} is not a regular file")
        if writer_problem(info, root_ok=True):
            raise SecretError(f"${SECRET_FILE_ENV}: {path} must be owned by this user or "
                              f"root and writable by no one else (owner uid {info.st_uid}, "
                              f"mode {stat.S_IMODE(info.st_mode):04o})")
        if info.st_mode & 0o004:
            log.warning("kvstrata: the deployment secret file %s is readable by every user; "
                        "make it 0600", path)
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise SecretError(f"${SECRET_FILE_ENV}: cannot read {path}: "
                          f"{exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_BYTES:        # before stripping: not a secret cut silently
        raise SecretError(f"${SECRET_FILE_ENV}: {path} is longer than {MAX_SECRET_BYTES} "
                          f"bytes")
    return data.strip()
