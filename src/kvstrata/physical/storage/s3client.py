"""A thin S3 client for the G4 object tier, over obstore (the Rust ``object_store`` crate).

:class:`S3Client` does one request per call, from any thread (obstore releases the GIL while
a request runs, so a thread pool keeps many in flight): :meth:`~S3Client.put_if_absent`
(conditional PUT, ``If-None-Match: *``), :meth:`~S3Client.get` (``None`` for a missing
object), :meth:`~S3Client.exists`, :meth:`~S3Client.list_keys`, :meth:`~S3Client.delete`,
:meth:`~S3Client.ensure_bucket`. :class:`S3Config` holds the endpoint, bucket, region,
credentials (defaults suit a local SeaweedFS), timeouts and a small retry budget: a request
that cannot finish quickly fails, and the engine recomputes the block instead of waiting.

Errors are typed: a missing object is not an error (``get`` returns ``None``, ``exists``
``False``); an object already there is not one either (``put_if_absent`` returns ``False``);
:class:`ObjectStoreTransientError` covers timeouts, refused or dropped connections, 5xx and
throttling (503 SlowDown, 429); :class:`ObjectStoreRequestError` covers what retrying will not
fix (403 denied, 400 bad request, other 4xx). Both are :class:`ObjectStoreError`.

Conditional PUT: ``If-None-Match: *`` makes "write once" atomic across workers; a 412 or 409
answer means the object exists (a 409, another writer's PUT of the key in flight, is asked
again twice, 20 and 100 ms apart, since that PUT may fail; then taken as such), and a 412 is
confirmed by a HEAD (SeaweedFS answers 412 for a key that an object
under ``key/`` made a directory: nothing is stored there, an error). A server that
does not implement it (501 NotImplemented, or obstore's "not supported") is remembered and
served by HEAD then PUT (two workers may then both write the same block; harmless, the bytes
are equal). ``S3Config(conditional_put=False)`` skips the attempt.

Why obstore -- ``bench/bench_s3clients.py`` against SeaweedFS 4.48 ``weed mini`` on this
2-core machine (the server shares the cores), payload GB/s put / get, N requests in flight,
best of two runs::

    object    N    boto3 1.44.5      obstore 0.12.1     obstore async
    64 KiB    8    0.019 / 0.029     0.035 / 0.096      0.038 / 0.076
    64 KiB   16    0.024 / 0.030     0.084 / 0.148      0.059 / 0.094
    256 KiB   8    0.063 / 0.100     0.142 / 0.321      0.155 / 0.474
    256 KiB  16    0.060 / 0.130     0.110 / 0.424      0.128 / 0.370
    2 MiB     8    0.157 / 0.650     0.191 / 0.717      0.166 / 0.906
    2 MiB    16    0.147 / 0.768     0.169 / 0.811      0.178 / 1.232

(boto3 in a thread pool, its CRC32 request/response checksums off, as kvstrata has its own
xxh3.) obstore beats boto3 everywhere: 1.2-3.5x on PUTs (which at 2 MiB are bound by the
server's write path) and 1.06-5x on GETs. Its blocking calls in threads and its asyncio API
trade places from run to run (an earlier run, 2 MiB GETs with 8 / 16 in flight: threads
0.886 / 1.014, asyncio 1.023 / 0.823 GB/s); kvstrata uses the blocking calls, since its
transfer engine runs on threads. boto3 is not a dependency.
"""

from __future__ import annotations

import datetime
import http.client
import os
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ..errors import StorageConfigError, StorageError

__all__ = ["S3Config", "S3Client", "ObjectStoreError", "ObjectStoreTransientError",
           "ObjectStoreRequestError"]

_STATUS = re.compile(r"status code: (\d{3})")


class ObjectStoreError(StorageError):
    """An S3 request failed; ``status`` is the HTTP status when there was one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ObjectTooLargeError(ObjectStoreError):
    """An object is larger than the reader accepts (it was not read); ``size`` says how
    large the store reports it."""

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size


class ObjectStoreTransientError(ObjectStoreError):
    """A failure that may pass: timeout, connection refused or dropped, 5xx, throttling."""


class ObjectStoreRequestError(ObjectStoreError):
    """A failure retrying will not fix: access denied, bad request, other 4xx."""


CONFLICT_PAUSES = (0.02, 0.1, None)
"""Seconds between the attempts of a conditional PUT answered 409 (another writer's
conditional PUT of the key in flight); ``None`` ends them."""


@dataclass(frozen=True)
class S3Config:
    """Where the object tier's bucket is and how long a request may take.

    ``access_key``/``secret_key`` ``None``: taken from ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``, else requests go unsigned (a SeaweedFS without identities).
    ``connect_timeout``: seconds to connect; ``read_timeout``: seconds a response may stall
    between reads; ``request_timeout``: seconds for a whole request; ``retries``: extra
    attempts after a 5xx, throttling or a dropped connection (obstore backs off 20-200 ms).
    ``conditional_put``: ``None`` tries ``If-None-Match`` and falls back to HEAD+PUT if the
    server does not support it; ``False`` always uses HEAD+PUT."""

    endpoint_url: str = "http://127.0.0.1:8333"
    bucket: str = "kvstrata"
    region: str = "us-east-1"
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)     # never in a repr or log
    connect_timeout: float = 1.0
    read_timeout: float = 2.0
    request_timeout: float = 5.0
    retries: int = 1
    conditional_put: bool | None = None
    virtual_hosted_style: bool = False

    def __post_init__(self) -> None:
        if not self.bucket or not isinstance(self.bucket, str):
            raise StorageConfigError(f"bucket must be a non-empty string, got {self.bucket!r}")
        scheme = urllib.parse.urlsplit(self.endpoint_url).scheme
        if scheme not in ("http", "https"):
            raise StorageConfigError(f"endpoint_url must be http(s)://..., got "
                                     f"{self.endpoint_url!r}")
        for name in ("connect_timeout", "read_timeout", "request_timeout"):
            if not getattr(self, name) > 0:
                raise StorageConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) \
                or self.retries < 0:
            raise StorageConfigError(f"retries must be an int >= 0, got {self.retries!r}")


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


class S3Client:
    """One bucket of an S3-compatible store (see the module docstring). Thread-safe."""

    def __init__(self, config: S3Config) -> None:
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError as exc:   # pragma: no cover - obstore is in requirements.txt
            raise StorageConfigError("the object tier needs obstore (pip install "
                                     "obstore==0.12.1)") from exc
        self._obs = obstore
        self.config = config
        access = config.access_key or os.environ.get("AWS_ACCESS_KEY_ID")
        secret = config.secret_key or os.environ.get("AWS_SECRET_ACCESS_KEY")
        credentials = (dict(access_key_id=access, secret_access_key=secret)
                       if access and secret else dict(skip_signature=True))
        self.signed = bool(access and secret)
        timeout = config.request_timeout
        try:
            self._store = S3Store(
                config.bucket, endpoint=config.endpoint_url, region=config.region,
                virtual_hosted_style_request=config.virtual_hosted_style,
                client_options={"allow_http": config.endpoint_url.startswith("http://"),
                                "connect_timeout": _duration(config.connect_timeout),
                                "read_timeout": _duration(config.read_timeout),
                                "timeout": _duration(timeout)},
                retry_config={"max_retries": config.retries,
                              "retry_timeout": datetime.timedelta(seconds=timeout),
                              "backoff": {"init_backoff": datetime.timedelta(milliseconds=20),
                                          "max_backoff": datetime.timedelta(milliseconds=200),
                                          "base": 2}},
                **credentials)
        except Exception as exc:
            raise StorageConfigError(f"cannot configure S3 client for {config.endpoint_url}: "
                                     f"{exc}") from exc
        self._conditional = config.conditional_put is not False
        self._lock = threading.Lock()

    @property
    def store(self):
        """The underlying ``obstore.store.S3Store`` (for tools and benchmarks)."""
        return self._store

    @property
    def conditional_put(self) -> bool:
        """Whether PUTs are sent with ``If-None-Match: *`` (false after a server refused it)."""
        return self._conditional

    # ------------------------------------------------------------------ objects
    def put_if_absent(self, key: str, body) -> bool:
        """Store ``body`` (a bytes-like object) under ``key`` unless an object is there.
        Returns ``True`` if this call wrote it, ``False`` if it was present.
        :class:`ObjectStoreRequestError` if the store answers that ``key`` exists but holds
        no object there (SeaweedFS, once a name below ``key`` made it a directory)."""
        if self._conditional:
            for pause in CONFLICT_PAUSES:
                try:
                    self._obs.put(self._store, key, body, mode="create", use_multipart=False)
                    return True
                except Exception as exc:
                    outcome = self._classify(exc, f"PUT {key}", conditional=True)
                    if outcome == "exists":
                        if _status_of(exc) == 409:
                            # AWS: another writer's conditional PUT of this key is in flight.
                            # It may yet fail, so ask again after a pause: its object (412),
                            # or room to write ours. Still in flight after the last: taken
                            # as that writer's (the same bytes).
                            if pause is None:
                                return False
                            time.sleep(pause)
                            continue
                        if not self.head(key):     # one HEAD, only when nothing was written
                            raise ObjectStoreRequestError(
                                f"PUT {key} on {self.config.endpoint_url}/{self.config.bucket}: "
                                f"the store answers that it exists, but holds no object there "
                                f"(a directory?); not stored", _status_of(exc)) from None
                        return False
                    if outcome != "unsupported":
                        raise outcome from None
                    with self._lock:
                        self._conditional = False
                    break
        if self.head(key):
            return False
        self.put(key, body)
        return True

    def put(self, key: str, body) -> None:
        """Store ``body`` under ``key``, replacing any object there."""
        try:
            self._obs.put(self._store, key, body, use_multipart=False)
        except Exception as exc:
            raise self._error(exc, f"PUT {key}") from None

    def get(self, key: str, *, max_bytes: int | None = None):
        """The object under ``key`` as a bytes-like object (an ``obstore.Bytes``: buffer
        protocol, no copy), or ``None`` if there is none. With ``max_bytes``, an object the
        store reports larger is not read: :class:`ObjectTooLargeError` (whoever can write
        the bucket could otherwise make a reader load any size)."""
        try:
            result = self._obs.get(self._store, key)
            size = result.meta["size"]
            if max_bytes is None or size <= max_bytes:
                return result.bytes()
        except Exception as exc:
            outcome = self._classify(exc, f"GET {key}")
            if outcome == "missing":
                return None
            raise outcome from None
        raise ObjectTooLargeError(f"GET {key}: the object is {size} bytes, more than the "
                                  f"{max_bytes} accepted; not read", size)

    def head(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""
        try:
            self._obs.head(self._store, key)
            return True
        except Exception as exc:
            outcome = self._classify(exc, f"HEAD {key}")
            if outcome == "missing":
                return False
            raise outcome from None

    def exists(self, keys: Iterable[str]) -> list[bool]:
        """:meth:`head` of each key, in order (one request after another)."""
        return [self.head(k) for k in keys]

    def delete(self, key: str) -> None:
        """Remove the object under ``key`` (no error if there is none)."""
        try:
            self._obs.delete(self._store, key)
        except Exception as exc:
            if self._classify(exc, f"DELETE {key}") != "missing":
                raise self._error(exc, f"DELETE {key}") from None

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        """Keys of the objects under ``prefix`` (a path: ``"a/b"`` lists ``a/b/...``), in
        pages of 1000."""
        try:
            for page in self._obs.list(self._store, prefix=prefix or None, chunk_size=1000):
                for meta in page:
                    yield meta["path"]
        except Exception as exc:
            outcome = self._classify(exc, f"LIST {prefix!r}")
            if outcome != "missing":
                raise outcome from None

    # ------------------------------------------------------------------ bucket
    def ensure_bucket(self) -> bool:
        """Create the bucket if it does not exist. Returns ``True`` if this call created it."""
        try:
            next(iter(self._obs.list(self._store, chunk_size=1)), None)
            return False
        except Exception as exc:
            if "NoSuchBucket" not in str(exc):
                raise self._error(exc, f"LIST bucket {self.config.bucket}") from None
        return self._create_bucket()

    def _create_bucket(self) -> bool:
        url = f"{self.config.endpoint_url.rstrip('/')}/{self.config.bucket}"
        if self.signed:   # a presigned PUT on the bucket's URL is CreateBucket
            url = self._obs.sign(self._store, "PUT", "", datetime.timedelta(seconds=60))
        parts = urllib.parse.urlsplit(url)
        cls = (http.client.HTTPSConnection if parts.scheme == "https"
               else http.client.HTTPConnection)
        conn = cls(parts.netloc, timeout=self.config.request_timeout)
        try:
            conn.request("PUT", parts.path + (f"?{parts.query}" if parts.query else ""),
                         headers={"Content-Length": "0"})
            response = conn.getresponse()
            body = response.read().decode("utf-8", "replace")
        except OSError as exc:
            raise ObjectStoreTransientError(f"create bucket {self.config.bucket}: {exc}") \
                from None
        finally:
            conn.close()
        if response.status == 200:
            return True
        if response.status == 409 and "BucketAlreadyOwnedByYou" in body:
            return False
        cls_error = (ObjectStoreTransientError if response.status >= 500
                     else ObjectStoreRequestError)
        raise cls_error(f"create bucket {self.config.bucket}: HTTP {response.status} "
                        f"{body[:200]}", response.status)

    def close(self) -> None:
        """Nothing to release (connections close with the client); kept for symmetry."""

    # ------------------------------------------------------------------ errors
    def _classify(self, exc: Exception, what: str, *, conditional: bool = False):
        """``"missing"``, ``"exists"``, ``"unsupported"`` (conditional PUT refused), or the
        typed error to raise."""
        exceptions = self._obs.exceptions
        if isinstance(exc, (FileNotFoundError, exceptions.NotFoundError)):
            return "missing"
        if isinstance(exc, (exceptions.AlreadyExistsError, exceptions.PreconditionError)):
            return "exists"
        status = _status_of(exc)
        if conditional:
            if status in (409, 412):
                return "exists"
            if isinstance(exc, exceptions.NotSupportedError) or status == 501 \
                    or "NotImplemented" in str(exc):
                return "unsupported"
        return self._error(exc, what)

    def _error(self, exc: Exception, what: str) -> ObjectStoreError:
        exceptions = self._obs.exceptions
        status = _status_of(exc)
        message = f"{what} on {self.config.endpoint_url}/{self.config.bucket}: {_first_line(exc)}"
        if isinstance(exc, (exceptions.PermissionDeniedError,
                            exceptions.UnauthenticatedError)):
            return ObjectStoreRequestError(message, status)
        if status is not None and 400 <= status < 500 and status not in (408, 429):
            return ObjectStoreRequestError(message, status)
        # 5xx, throttling, timeouts, refused/dropped connections, body read errors
        return ObjectStoreTransientError(message, status)


def _status_of(exc: Exception) -> int | None:
    match = _STATUS.search(str(exc))
    return int(match.group(1)) if match else None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:500]
