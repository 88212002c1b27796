"""Who may talk to an exporter's control port: peers that hold the deployment's shared secret.

Everything an exporter answers says what users asked (``has`` tells whether a prefix is
cached; a lease names the slots of its blocks, which NIXL then reads), so a control port
answers nothing to a peer that has not proved it holds the secret. The proof is mutual and
never sends the secret:

1. the reader sends ``{"op": "hello", "nonce": nc}`` (32 random bytes);
2. the exporter answers ``{"nonce": ns, "proof": HMAC(secret, "kvstrata server" | nc | ns)}``
   and the reader checks it (it talks to an exporter of its deployment, not an impostor);
3. the reader sends ``{"op": "auth", "proof": HMAC(secret, "kvstrata client" | nc | ns)}``;
   the exporter checks it and answers ``{"ok": true}``.

Anything else before that, or a wrong proof, closes the connection unanswered. HMAC-SHA256,
compared in constant time; fresh nonces on both sides, so a recorded exchange proves nothing
on another connection, and the two labels keep an exporter's proof from being replayed as a
reader's.

The secret (at least :data:`MIN_SECRET_BYTES`; make it random, ``openssl rand -hex 32``: an
exporter answers the hello to anyone, so a guessable secret can be tested offline) comes
from the caller, else from ``$KVSTRATA_SHARING_SECRET``, else from the file
``$KVSTRATA_SHARING_SECRET_FILE`` (a regular file, links followed as Kubernetes mounts its
secrets, owned by the running user or root and writable by no one else). Not from a command
line or a JSON config: those show in process listings.

What this does not do: it authenticates the connection's start, not each message after it (no
session MAC, no TLS), so a party on the network path could relay a handshake and then speak
on the connection. Keep control ports on networks of the deployment.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from typing import Mapping

__all__ = ["SECRET_ENV", "SECRET_FILE_ENV", "MIN_SECRET_BYTES", "AuthError", "resolve_secret",
           "new_nonce", "server_proof", "client_proof", "proofs_match"]

SECRET_ENV = "KVSTRATA_SHARING_SECRET"
SECRET_FILE_ENV = "KVSTRATA_SHARING_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
NONCE_BYTES = 32

log = logging.getLogger(__name__)


class AuthError(ValueError):
    """No usable shared secret, or a peer that failed to prove it holds it."""


def resolve_secret(secret: bytes | str | None = None,
                   env: Mapping[str, str] | None = None) -> bytes | None:
    """The shared secret: ``secret`` if given, else ``$KVSTRATA_SHARING_SECRET``, else the
    contents of ``$KVSTRATA_SHARING_SECRET_FILE``; None when none is set. ``AuthError`` when
    the one given is shorter than :data:`MIN_SECRET_BYTES` or its file is not private."""
    env = os.environ if env is None else env
    source = "the secret given"
    if secret is None and env.get(SECRET_ENV):
        secret, source = env[SECRET_ENV], f"${SECRET_ENV}"
    elif secret is None and env.get(SECRET_FILE_ENV):
        secret, source = _read_secret_file(env[SECRET_FILE_ENV]), f"${SECRET_FILE_ENV}"
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.strip().encode()
    if not isinstance(secret, bytes) or not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise AuthError(f"{source}: a sharing secret is {MIN_SECRET_BYTES} to "
                        f"{MAX_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32`)")
    return secret


def _read_secret_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise AuthError(f"${SECRET_FILE_ENV}: cannot open {path}: "
                        f"{exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AuthError(f"${SECRET_FILE_ENV}: {path} is not a regular file")
        if info.st_uid not in (os.geteuid(), 0) or info.st_mode & 0o022:
            raise AuthError(f"${SECRET_FILE_ENV}: {path} must be owned by this user or root "
                            f"and writable by no one else (owner uid {info.st_uid}, mode "
                            f"{stat.S_IMODE(info.st_mode):04o})")
        if info.st_mode & 0o004 and info.st_uid != 0:
            log.warning("kvstrata: the sharing secret file %s is readable by every user; "
                        "make it 0600", path)
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise AuthError(f"${SECRET_FILE_ENV}: cannot read {path}: "
                        f"{exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return data.strip()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _proof(label: bytes, secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, label + client_nonce + server_nonce, hashlib.sha256).digest()


def server_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What an exporter answers to prove it holds ``secret``."""
    return _proof(b"kvstrata server|", secret, client_nonce, server_nonce)


def client_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What a reader sends to prove it holds ``secret``."""
    return _proof(b"kvstrata client|", secret, client_nonce, server_nonce)


def proofs_match(expected: bytes, given: object) -> bool:
    """Whether ``given`` is ``expected`` (constant time; anything but bytes is not)."""
    return isinstance(given, bytes) and hmac.compare_digest(expected, given)
