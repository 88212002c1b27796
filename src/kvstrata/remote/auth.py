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

The secret is the deployment's (:mod:`kvstrata.secret`: ``$KVSTRATA_SHARING_SECRET`` or a
private file; make it random, ``openssl rand -hex 32``: an exporter answers the hello to
anyone, so a guessable secret can be tested offline).

What this does not do: it authenticates the connection's start, not each message after it (no
session MAC, no TLS), so a party on the network path could relay a handshake and then speak
on the connection. Keep control ports on networks of the deployment.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from ..secret import MIN_SECRET_BYTES, SECRET_ENV, SECRET_FILE_ENV, SecretError, resolve_secret

__all__ = ["SECRET_ENV", "SECRET_FILE_ENV", "MIN_SECRET_BYTES", "AuthError", "resolve_secret",
           "new_nonce", "server_proof", "client_proof", "proofs_match"]

NONCE_BYTES = 32


class AuthError(SecretError):
    """No usable shared secret, or a peer that failed to prove it holds it."""


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
