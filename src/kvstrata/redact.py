"""Credentials kept out of what kvstrata shows: error messages, logs, metric labels.

A URL a user gives may carry a password (``nats://user:password@host``, ``http://key:secret@
host/bucket``) or a signed query string (a presigned S3 URL). Everything that repeats such
a URL back (a message saying what is wrong with it, a log line naming where events go) shows
:func:`redacted` of it instead.
"""

from __future__ import annotations

__all__ = ["redacted"]


def redacted(url: str, *, query: bool = True) -> str:
    """``url`` with any ``user:password@`` or ``token@`` replaced by ``***@`` and, unless
    ``query`` is false (a query known to hold only options), its query string by ``?***``.
    Also for text that is not a well-formed URL: whatever precedes the last ``@`` goes."""
    if not isinstance(url, str):
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    # the credentials end at the last "@": a password may hold a "/" (base64 does), a "?"
    # or a "#" (typed without percent-encoding), so neither the authority's end nor the
    # query's start can be trusted to come first (an "@" further on hides more, not less)
    if "@" in rest:
        rest = "***@" + rest[rest.rindex("@") + 1:]
    authority, slash, path = rest.partition("/")
    if query:
        path, mark, _ = path.partition("?")
        if not slash:
            authority, mark_in_authority, _ = authority.partition("?")
            mark = mark or mark_in_authority
        path += "?***" if mark else ""
    return f"{scheme}{sep}{authority}{slash}{path}"
