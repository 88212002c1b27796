"""G4 object storage: blocks as objects in an S3-compatible bucket, addressed by keys.

``ObjectStorage(config, s3, namespace=..., fingerprint=...)`` stores block ``key`` as the
object ``namespace + key`` of the bucket :class:`~.s3client.S3Config` names; every worker that
opens the same bucket and namespace sees the same blocks (the tier is shared and outlives the
process). Keys are chosen by the planner (:func:`kvstrata.placement.keys.block_key`: the
block's sequence, local and parent hash). ``config`` gives the geometry (FullyContiguous blocks of
``block_bytes``); its ``num_blocks`` plays no part in addressing.

Each object is a header plus the block's payload (:mod:`.object_format`): the header records
the compatibility ``fingerprint``, the geometry, the sequence hash and the payload's xxh3-64.

* :meth:`ObjectStorage.write_blocks` writes a batch with conditional PUTs (``If-None-Match:
  *``): a key the bucket already holds is left as it is and counted in
  ``puts_skipped_existing`` (blocks are immutable: same key, same bytes). A block is hashed
  as it is copied into the request body, and one whose bytes do not match the checksum the
  caller recorded fails (``CHECKSUM_MISMATCH``) instead of being stored: an object nobody can
  replace must not be born corrupt.
* :meth:`ObjectStorage.read_blocks` fetches a batch and copies a payload into its destination
  only after checking magic, version, fingerprint, geometry, sequence hash, length and
  checksum. A missing object is a ``NOT_FOUND`` failure; another model's, another geometry's
  or another block's object a ``HASH_MISMATCH``; a truncated or altered one a
  ``CHECKSUM_MISMATCH``; a timeout, refused connection, 5xx or throttling an ``IO_ERROR``.
  A key whose object failed its checks is remembered (:meth:`ObjectStorage.found_bad`), so a
  listing can pass it over.

Reads (and HEADs) and writes run on two thread pools of ``max_concurrency`` threads each, one
request per block, so a load never queues behind a store. Failures are per block: the call
raises one :class:`~kvstrata.physical.errors.BlockIOError` subclass whose ``failures`` name the
failed positions (``block_id`` -1: the tier has no slots); every other block completed. A
batch never waits longer than its requests' timeouts allow, counting the requests queued ahead
of it on its pool: whatever is still running at the batch deadline fails with ``IO_ERROR``,
and from then on no thread of that batch reads its sources or writes its destinations (a late
reply is dropped): a caller's buffers are never touched after the call returned, and only
verified payloads are ever copied into them.

Counters (:attr:`ObjectStorage.counters`): objects written and skipped, objects read and
missed, failures, payload bytes written and read.
"""

from __future__ import annotations

import math
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..checksum import block_checksum
from ..errors import (BlockFailure, FailureKind, StorageConfigError, StorageError,
                      raise_for_failures)
from ...protocol.layout import FullyContiguousLayout, LayoutConfig
from ...protocol.layout_codec import StorageDescriptor
from .base import BlockStore, StorageStatus
from .object_format import (HEADER_SIZE, ObjectCorruptError, ObjectFormatError, ObjectGeometry,
                            check_fingerprint, decrypt_payload, encode_header, object_identity,
                            open_object)
from ..tags import BlockCipher, BlockTagger
from .s3client import ObjectStoreError, ObjectTooLargeError, S3Client, S3Config

__all__ = ["ObjectStorage", "ObjectCounters"]

_SEGMENT = re.compile(r"[A-Za-z0-9._=+:@,~-]+")

_BAD_KEYS_KEPT = 4096
"""Keys remembered as holding a bad object (:meth:`ObjectStorage.found_bad`), newest kept."""


@dataclass
class ObjectCounters:
    """What an :class:`ObjectStorage` did since it was opened (for metrics and tests)."""

    puts: int = 0                   # objects written
    puts_skipped_existing: int = 0  # conditional PUTs that found the object already there
    gets: int = 0                   # objects read and verified
    misses: int = 0                 # GETs of keys with no object
    failures: int = 0               # blocks that failed otherwise (I/O, integrity)
    bytes_written: int = 0          # payload bytes of the objects written
    bytes_read: int = 0             # payload bytes of the objects read

    @property
    def bytes(self) -> int:
        """Payload bytes moved either way."""
        return self.bytes_written + self.bytes_read

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "bytes": self.bytes}


def _check_path(what: str, value: str) -> None:
    segments = value.split("/")
    if not value or not all(_SEGMENT.fullmatch(s) and s not in (".", "..") for s in segments):
        raise ValueError(f"{what} {value!r}: '/'-separated segments of letters, digits and "
                         f"._=+:@,~- only")


class _Gate:
    """Lets pool threads touch a caller's buffers only while the caller still waits for the
    batch: :meth:`close` (at the end of the call) waits for the threads inside, then shuts."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._inside = 0

    def enter(self) -> bool:
        with self._cond:
            if self._open:
                self._inside += 1
            return self._open

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            if not self._inside:
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: self._inside == 0)


class _Abandoned(Exception):
    """The batch ended (deadline) before this block's thread got to the caller's buffer."""


class _SourceChanged(ObjectFormatError):
    """A block to store does not match the checksum recorded for it (its bytes changed
    since it was hashed): it is not stored."""


class _Lane:
    """A thread pool for one kind of request, and how many of its requests are queued or
    running (a new batch waits behind those)."""

    def __init__(self, threads: int, name: str) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._outstanding = 0

    def submit(self, calls: Sequence[Callable[[], Any]]) -> tuple[list[Future], int]:
        """Queue ``calls``: their futures, and how many requests were ahead of them."""
        with self._lock:
            ahead = self._outstanding
            self._outstanding += len(calls)
            futures = [self.pool.submit(call) for call in calls]
        for future in futures:
            future.add_done_callback(self._done)   # also when cancelled
        return futures, ahead

    def _done(self, _future: Future) -> None:
        with self._lock:
            self._outstanding -= 1


class ObjectStorage(BlockStore):
    """Block objects in a bucket (G4). See the module docstring for format and failures.

    ``s3`` is an :class:`S3Config` (a client is made for it) or a ready client with the
    :class:`S3Client` methods. ``namespace`` is the key prefix (e.g.
    ``"kvstrata/<fingerprint>/<salt>/"``, '/'-terminated); ``fingerprint`` (at most 64 bytes
    of UTF-8) is written into every object and must match on every read.
    ``ensure_bucket`` creates the bucket if it is missing."""

    kind = "object"

    def __init__(self, config: LayoutConfig, s3: S3Config | S3Client, *, namespace: str,
                 fingerprint: str, max_concurrency: int = 16,
                 ensure_bucket: bool = True, tagger: BlockTagger | None = None,
                 cipher: BlockCipher | None = None, encrypt: bool = False) -> None:
        super().__init__(FullyContiguousLayout(config))
        namespace = namespace.strip("/")
        try:
            _check_path("namespace", namespace)
            check_fingerprint(fingerprint)
        except ValueError as exc:
            raise StorageConfigError(str(exc)) from None
        if max_concurrency < 1:
            raise StorageConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.namespace = namespace + "/"
        self.fingerprint = fingerprint
        self.tagger = tagger
        """Tags every object put and checks the tag of every object got (None: unkeyed,
        for tests and tools; a G4 tier always has one, :mod:`kvstrata.kinds.object_store`)."""
        if cipher is not None and tagger is None:
            raise StorageConfigError("an object store with a cipher needs a tagger too: an "
                                     "object stored in clear must still carry its tag")
        if encrypt and cipher is None:
            raise StorageConfigError("encrypting an object store needs a cipher")
        self.cipher = cipher
        """Opens encrypted objects (None: they are refused); objects in clear still need
        their tag."""
        self.encrypt = encrypt
        """Encrypt every payload put (``encrypt_at_rest``)."""
        self.geometry = ObjectGeometry.of(config)
        self.client = S3Client(s3) if isinstance(s3, S3Config) else s3
        self.max_concurrency = max_concurrency
        self.counters = ObjectCounters()
        self._counter_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}
        self._bad_keys: OrderedDict[str, None] = OrderedDict()
        if ensure_bucket:
            self.client.ensure_bucket()

    # ------------------------------------------------------------------ data path
    @property
    def write_round(self) -> int:
        """A paced write goes one round of :attr:`max_concurrency` PUTs at a time."""
        return self.max_concurrency

    def write_blocks(self, keys: Sequence[str], sources: Sequence[np.ndarray],
                     sequence_hashes: Sequence[int], *,
                     checksums: Sequence[int | None] | None = None,
                     parent_hashes: Sequence[int | None] | None = None,
                     local_hashes: Sequence[int] | None = None) -> list[int]:
        """Store ``sources[i]`` (``uint8`` arrays of at least ``block_bytes``) as the object
        of ``keys[i]``, unless the bucket already holds that key. Returns each block's
        xxh3-64; raises a :class:`BlockIOError` subclass naming the failed positions (its
        ``.checksums`` has ``None`` for those).

        ``checksums``, when given, are the blocks' known xxh3-64 (e.g. recorded when they
        entered G2): a source whose bytes no longer match fails (``CHECKSUM_MISMATCH``) and
        is not stored. Every block is hashed as it is copied into its request. The blocks'
        identity (``parent_hashes``, ``local_hashes``) is already in their keys
        (:mod:`kvstrata.placement.keys`): nothing else records it."""
        self._check_batch(keys, sources, sequence_hashes)
        if checksums is not None and len(checksums) != len(keys):
            raise ValueError(f"{len(checksums)} checksums for {len(keys)} blocks")
        block_bytes = self.config.block_bytes
        known = [None] * len(keys) if checksums is None else list(checksums)

        def put(gate: _Gate, p: int) -> tuple[int, bool]:
            body = np.empty(HEADER_SIZE + block_bytes, np.uint8)
            payload = body[HEADER_SIZE:]
            if not gate.enter():
                raise _Abandoned()
            try:     # the only time the caller's source is read
                payload[:] = sources[p][:block_bytes]
            finally:
                gate.leave()
            # hash the copy that is sent: the header must describe exactly these bytes
            checksum = block_checksum(payload)
            if known[p] is not None and checksum != known[p]:
                raise _SourceChanged(f"block xxh3-64 {checksum:#018x} != recorded "
                                     f"{known[p]:#018x}: its bytes changed; not stored")
            header = dict(fingerprint=self.fingerprint, geometry=self.geometry,
                          sequence_hash=sequence_hashes[p], checksum=checksum)
            where = self.namespace + keys[p]
            if not self.encrypt:
                body[:HEADER_SIZE] = np.frombuffer(encode_header(
                    **header, tagger=self.tagger, payload=payload, where=where), np.uint8)
            else:
                seal = self.cipher.encrypt(object_identity(where, encode_header(**header)),
                                           sequence_hashes[p], payload, payload)
                body[:HEADER_SIZE] = np.frombuffer(encode_header(**header, seal=seal),
                                                   np.uint8)
            return checksum, self.client.put_if_absent(where, body)

        outcomes, failures = self._run_batch("write", put, len(keys))
        sums: list[int | None] = [None] * len(keys)
        written = skipped = 0
        for p, outcome in outcomes.items():
            sums[p] = outcome[0]
            written += outcome[1]
            skipped += not outcome[1]
        self._judge(keys, good=[p for p, o in outcomes.items() if o[1]], failures=())
        self._count(puts=written, puts_skipped_existing=skipped, failures=len(failures),
                    bytes_written=written * block_bytes)
        raise_for_failures(f"put to {self._where()}", failures, len(keys), sums)
        return sums  # type: ignore[return-value]

    def read_blocks(self, keys: Sequence[str], destinations: Sequence[np.ndarray],
                    sequence_hashes: Sequence[int]) -> list[int]:
        """Fetch the objects of ``keys`` and copy each verified payload into
        ``destinations[i]`` (``uint8`` arrays of at least ``block_bytes``). Returns the
        verified xxh3-64 of each block. Raises a :class:`BlockIOError` subclass naming the
        failed positions (``NOT_FOUND``, ``HASH_MISMATCH``, ``CHECKSUM_MISMATCH``,
        ``IO_ERROR``; its ``.checksums`` holds the good blocks' values). A failed destination
        must not be used; nothing but a verified payload is ever copied into a destination
        (an encrypted one is decrypted into it and then verified: a failure leaves garbage
        there), and nothing at all after this call returned."""
        self._check_batch(keys, destinations, sequence_hashes)
        block_bytes = self.config.block_bytes

        def get(gate: _Gate, p: int) -> int | None:
            where = self.namespace + keys[p]
            try:    # an object is its header and the block: anything larger is not read
                data = self.client.get(where, max_bytes=HEADER_SIZE + block_bytes)
            except ObjectTooLargeError as exc:
                raise ObjectCorruptError(f"object is {exc.size} bytes, more than a header "
                                         f"and a block ({HEADER_SIZE + block_bytes}); not "
                                         f"read") from None
            if data is None:
                return None
            header, payload = open_object(data, fingerprint=self.fingerprint,
                                          geometry=self.geometry,
                                          sequence_hash=sequence_hashes[p],
                                          tagger=self.tagger, where=where)
            if not gate.enter():
                raise _Abandoned()
            try:     # only while the caller waits; verified bytes, or (decrypting) bytes
                out = destinations[p][:block_bytes]       # that fail and are not used
                if header.encrypted:
                    decrypt_payload(data, header, payload, cipher=self.cipher, where=where,
                                    out=out)
                else:
                    out[:] = np.frombuffer(payload, np.uint8)
            finally:
                gate.leave()
            return header.checksum

        outcomes, failures = self._run_batch("read", get, len(keys))
        sums: list[int | None] = [None] * len(keys)
        misses = 0
        for p, checksum in outcomes.items():
            if checksum is None:
                misses += 1
                failures.append(BlockFailure(p, -1, FailureKind.NOT_FOUND,
                                             f"no object {self.namespace}{keys[p]}"))
            else:
                sums[p] = checksum
        good = len(outcomes) - misses
        self._judge(keys, good=[p for p, c in outcomes.items() if c is not None],
                    failures=failures)
        self._count(gets=good, misses=misses, failures=len(failures) - misses,
                    bytes_read=good * block_bytes)
        raise_for_failures(f"get from {self._where()}", failures, len(keys), sums)
        return sums  # type: ignore[return-value]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether the bucket holds an object under each key (HEAD requests in parallel;
        does not read or verify them). Raises :class:`~.s3client.ObjectStoreError` if a
        request fails."""
        self._check_open()
        for key in keys:
            self._check_key(key)
        if not keys:
            return []
        futures, _ = self._lane("read").submit(
            [lambda k=k: self.client.head(self.namespace + k) for k in keys])
        return [f.result() for f in futures]

    def list_keys(self, limit: int | None = None,
                  accept: Callable[[str], bool] | None = None,
                  last: str | None = None) -> list[str]:
        """Keys of the objects directly under the namespace, sorted (names under a deeper
        prefix are not keys of this storage and are left out); only those ``accept`` takes,
        when given, and at most ``limit`` of them (the first the store lists): names it
        refuses neither count nor are kept, so whoever can write the bucket cannot hide keys
        behind junk names. With ``last``, the listing stops at the first name past it (the
        store lists in order). Which names are blocks is the key scheme's business
        (:func:`kvstrata.placement.keys.parse_block_key`)."""
        self._check_open()
        out = []
        for name in self.client.list_keys(self.namespace.rstrip("/")):
            rest = name[len(self.namespace):] if name.startswith(self.namespace) else ""
            # By its first segment: S3 lists in byte order, SeaweedFS a directory's entries
            # in order with what is under one right after it ("k/x" before "k-").
            if last is not None and rest.split("/", 1)[0] > last:
                break
            if rest and "/" not in rest and (accept is None or accept(rest)):
                out.append(rest)
                if limit is not None and len(out) >= limit:
                    break
        return sorted(out)

    def found_bad(self, key: str) -> bool:
        """Whether the object under ``key`` failed its checks (identity, checksum, tag) the
        last time this storage read it, and no good read or write of the key came since (the
        last few thousand such keys are remembered)."""
        with self._counter_lock:
            return key in self._bad_keys

    # ------------------------------------------------------------------ helpers
    def _run_batch(self, verb: str, work: Callable[[_Gate, int], Any], n: int
                   ) -> tuple[dict[int, Any], list[BlockFailure]]:
        """Run ``work(gate, p)`` for every position on the ``verb`` pool; the results of
        those that returned, and failures of those that raised or outlived the batch
        deadline."""
        gate = _Gate()
        queued, ahead = self._lane(verb).submit(
            [lambda p=p: work(gate, p) for p in range(n)])
        futures = dict(zip(queued, range(n)))
        done, pending = wait(futures, timeout=self._deadline(n, ahead))
        gate.close()     # from here on no thread touches the caller's buffers
        late = {f for f in pending if f.done()}   # finished while the gate closed
        done, pending = done | late, pending - late
        results: dict[int, Any] = {}
        failures: list[BlockFailure] = []
        for future in pending:
            future.cancel()
            failures.append(BlockFailure(futures[future], -1, FailureKind.IO_ERROR,
                                         f"{verb} did not finish within the batch deadline"))
        for future in done:
            p = futures[future]
            exc = future.exception()
            if exc is None:
                results[p] = future.result()
            elif isinstance(exc, _Abandoned):
                failures.append(BlockFailure(p, -1, FailureKind.IO_ERROR,
                                             f"{verb} did not finish within the batch deadline"))
            elif isinstance(exc, ObjectFormatError):
                failures.append(BlockFailure(p, -1, exc.failure_kind, str(exc)))
            elif isinstance(exc, (ObjectStoreError, OSError)):
                failures.append(BlockFailure(p, -1, FailureKind.IO_ERROR, str(exc)))
            else:
                failures.append(BlockFailure(p, -1, FailureKind.INTERNAL,
                                             f"{type(exc).__name__}: {exc}"))
        return results, failures

    def _deadline(self, n: int, ahead: int = 0) -> float:
        """Seconds a batch of ``n`` requests, queued behind ``ahead`` others on its pool, may
        take: every round of ``max_concurrency`` requests gets its full timeout budget
        (retries included), plus a margin. Behind others, its requests start as theirs end,
        out of step: one round more."""
        cfg = getattr(self.client, "config", None)
        if cfg is None:
            return 60.0
        per_request = (cfg.retries + 1) * (cfg.request_timeout + cfg.connect_timeout) + 0.5
        rounds = math.ceil((ahead + n) / self.max_concurrency) + (1 if ahead else 0)
        return rounds * per_request + 1.0

    def _lane(self, verb: str) -> _Lane:
        """The pool of reads (and HEADs) or of writes: a load never waits behind a store."""
        with self._pool_lock:
            self._check_open()
            lane = self._lanes.get(verb)
            if lane is None:
                lane = self._lanes[verb] = _Lane(self.max_concurrency, f"kvstrata-g4-{verb}")
            return lane

    def _judge(self, keys: Sequence[str], good: Sequence[int],
               failures: Sequence[BlockFailure]) -> None:
        """Remember the keys whose objects failed their checks; forget those read or
        written fine."""
        bad = [keys[f.position] for f in failures
               if f.kind in (FailureKind.CHECKSUM_MISMATCH, FailureKind.HASH_MISMATCH)]
        if not bad and not self._bad_keys:
            return
        with self._counter_lock:
            for p in good:
                self._bad_keys.pop(keys[p], None)
            for key in bad:
                self._bad_keys[key] = None
                self._bad_keys.move_to_end(key)
            while len(self._bad_keys) > _BAD_KEYS_KEPT:
                self._bad_keys.popitem(last=False)

    def _check_key(self, key: str) -> None:
        if not isinstance(key, str):
            raise ValueError(f"object keys must be strings, got {key!r}")
        _check_path("object key", key)

    def _check_batch(self, keys, buffers, sequence_hashes) -> None:
        self._check_open()
        if not len(keys) == len(buffers) == len(sequence_hashes):
            raise ValueError(f"batch lengths differ: {len(keys)} keys, {len(buffers)} "
                             f"buffers, {len(sequence_hashes)} sequence hashes")
        if len(set(keys)) != len(keys):
            raise ValueError("a batch names the same key twice")
        for key in keys:
            self._check_key(key)
        for buf in buffers:
            if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size < self.config.block_bytes:
                raise ValueError(f"block buffers must be 1-D uint8 arrays of at least "
                                 f"{self.config.block_bytes} bytes")

    def _count(self, **deltas: int) -> None:
        with self._counter_lock:
            for name, value in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + value)

    def _where(self) -> str:
        cfg = getattr(self.client, "config", None)
        if cfg is None:
            return self.namespace
        return f"{cfg.endpoint_url.rstrip('/')}/{cfg.bucket}/{self.namespace}"

    # ------------------------------------------------------------------ description
    def status(self) -> StorageStatus:
        cfg = self.config
        notes = [f"conditional_put={getattr(self.client, 'conditional_put', None)}",
                 f"max_concurrency={self.max_concurrency}"]
        notes += [f"{k}={v}" for k, v in self.counters.to_dict().items()]
        return StorageStatus(kind=self.kind, blocks=cfg.num_blocks, block_bytes=cfg.block_bytes,
                             bytes=self.counters.bytes_written, path=self._where(),
                             notes=tuple(notes))

    def descriptors(self) -> tuple[StorageDescriptor, ...]:
        """None: the tier is not memory or a file; peers reach it through the bucket and
        namespace (``status().path``)."""
        return ()

    def share(self) -> dict[str, Any]:
        raise StorageError("object storage is shared through its bucket and namespace "
                           f"({self._where()}), not a layout descriptor")

    def close(self) -> None:
        """Stop the request threads (after the requests in flight end). Idempotent."""
        with self._pool_lock:
            if self.closed:
                return
            super().close()
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.pool.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.client, "close", None)
        if close is not None:
            close()

