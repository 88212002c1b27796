"""The on-object format of the G4 object tier: a fixed header, then the block's payload.

Each object holds one block: :data:`HEADER_SIZE` bytes of header followed by the block's
FullyContiguous payload (``block_bytes``). The header (little-endian) says whose block it is,
so a reader never hands out bytes of another model, geometry or sequence::

    offset  size  field
    0       8     magic b"KVSTRATA"
    8       2     format version (:data:`FORMAT_VERSION`)
    10      2     header size (bytes before the payload)
    12      2     fingerprint length
    14      64    compatibility fingerprint (UTF-8, zero padded)
    78      16    dtype name (ASCII, zero padded)
    94      4x4   num_layers, outer_dim, page_size, inner_dim
    110     8     block_bytes
    118     8     sequence hash (u64)
    126     8     xxh3-64 of the payload
    134     8     payload length
    142     8     keyed tag of the object's key, bytes 0..141, the sequence hash and
                  the payload (:mod:`kvstrata.physical.tags`; 0 when written without a
                  key, or encrypted)
    150     2     flags: bit 0, the payload is encrypted (AES-256-GCM)
    152     32    the encrypted payload's seal (salt, GCM tag); zeros otherwise
    184     8     xxh3-64 of header bytes 0..183

An encrypted object's checksum field is the xxh3-64 of the plaintext, checked after
decryption; its additional authenticated data is the object's key and header bytes 0..141,
as a tag's identity (:func:`decrypt_payload`).

:func:`encode_header` builds a header, :func:`decode_header` parses one (raising an
:class:`ObjectFormatError` subclass on wrong magic, another version, truncation or a corrupt
header) and :func:`open_object` checks a whole object against what the reader expects
(fingerprint, geometry, sequence hash, payload length, payload checksum) and returns its
header and a zero-copy view of the verified payload; given the deployment's
:class:`~kvstrata.physical.tags.BlockTagger` it also checks the tag, so an object anyone
with the bucket's credentials wrote (or moved under another key, model or sequence) is
refused unless they hold the deployment's secret. Every error class names the
:class:`~kvstrata.protocol.results.FailureKind` it becomes for a block (``failure_kind``):
objects that are not this block (garbage, another format version, fingerprint, geometry or
sequence hash) are ``HASH_MISMATCH``; this block's object damaged (truncated, bytes changed) is
``CHECKSUM_MISMATCH``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..checksum import block_checksum
from ..errors import FailureKind, StorageError
from ..tags import BlockTagger
from ...protocol.layout import LayoutConfig

__all__ = ["MAGIC", "FORMAT_VERSION", "HEADER_SIZE", "MAX_FINGERPRINT_BYTES", "ObjectGeometry",
           "ObjectHeader", "ObjectFormatError", "ObjectMagicError", "ObjectVersionError",
           "ObjectTruncatedError", "ObjectCorruptError", "ForeignObjectError",
           "ObjectForgedError", "TAG_OFFSET", "ENCRYPTED", "decrypt_payload",
           "object_identity",
           "check_fingerprint", "encode_header", "decode_header", "open_object"]

MAGIC = b"KVSTRATA"
FORMAT_VERSION = 2
MAX_FINGERPRINT_BYTES = 64
_MAX_DTYPE_BYTES = 16
_FIELDS = struct.Struct("<8sHHH64s16sIIIIQQQQQH32s")
ENCRYPTED = 1
"""Header flag: the payload is encrypted."""
TAG_OFFSET = 142
"""Header bytes before the tag: what the tag covers of the header."""
_HEADER_HASH = struct.Struct("<Q")
HEADER_SIZE = _FIELDS.size + _HEADER_HASH.size
"""Bytes before the payload (192)."""


# --------------------------------------------------------------------------- errors
class ObjectFormatError(StorageError):
    """An object is not a valid kvstrata object for the block that was asked for."""

    failure_kind = FailureKind.CHECKSUM_MISMATCH


class ObjectMagicError(ObjectFormatError):
    """The object does not start with :data:`MAGIC` (not written by kvstrata)."""

    failure_kind = FailureKind.HASH_MISMATCH


class ObjectVersionError(ObjectFormatError):
    """The object was written in another format version."""

    failure_kind = FailureKind.HASH_MISMATCH


class ObjectTruncatedError(ObjectFormatError):
    """The object is shorter than its header says."""


class ObjectCorruptError(ObjectFormatError):
    """Header or payload bytes do not match their checksum, or fields are inconsistent."""


class ForeignObjectError(ObjectFormatError):
    """A valid object of another fingerprint, geometry or sequence hash."""

    failure_kind = FailureKind.HASH_MISMATCH


class ObjectForgedError(ObjectFormatError):
    """An object well formed for the block asked for, but without this deployment's tag:
    written by someone without the key (or under another key, or none)."""

    failure_kind = FailureKind.CHECKSUM_MISMATCH


# --------------------------------------------------------------------------- header
@dataclass(frozen=True)
class ObjectGeometry:
    """The block geometry an object records (a :class:`LayoutConfig` minus pool size and
    alignment, which do not change the payload)."""

    num_layers: int
    outer_dim: int
    page_size: int
    inner_dim: int
    dtype: str
    block_bytes: int

    @classmethod
    def of(cls, config: LayoutConfig) -> "ObjectGeometry":
        return cls(config.num_layers, config.outer_dim, config.page_size, config.inner_dim,
                   config.dtype, config.block_bytes)


@dataclass(frozen=True)
class ObjectHeader:
    """A decoded header (see the module docstring for the byte layout)."""

    version: int
    header_size: int
    fingerprint: str
    geometry: ObjectGeometry
    sequence_hash: int
    checksum: int
    payload_length: int
    tag: int = 0
    flags: int = 0
    seal: bytes = bytes(32)

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & ENCRYPTED)


def _fingerprint_bytes(fingerprint: str) -> bytes:
    raw = fingerprint.encode("utf-8")
    if len(raw) > MAX_FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint is {len(raw)} bytes; at most {MAX_FINGERPRINT_BYTES}")
    return raw


def check_fingerprint(fingerprint: str) -> None:
    """Raise ``ValueError`` if ``fingerprint`` does not fit the header."""
    _fingerprint_bytes(fingerprint)


def encode_header(*, fingerprint: str, geometry: ObjectGeometry, sequence_hash: int,
                  checksum: int, payload_length: int | None = None,
                  tagger: BlockTagger | None = None, payload=None, where: str = "",
                  seal: bytes | None = None) -> bytes:
    """The :data:`HEADER_SIZE`-byte header of a block's object (``payload_length`` defaults
    to ``geometry.block_bytes``), tagged with ``tagger`` over ``payload`` and ``where`` (the
    object's whole key: namespace, tenant, and the block's identity in its name) when given;
    ``seal`` marks the payload encrypted (its seal from
    :meth:`~kvstrata.physical.tags.BlockCipher.encrypt`, over :func:`object_identity`).
    Raises ``ValueError`` for a fingerprint over 64 bytes, a dtype name over 16 or values
    out of range."""
    dtype = geometry.dtype.encode("ascii")
    if len(dtype) > _MAX_DTYPE_BYTES:
        raise ValueError(f"dtype name {geometry.dtype!r} is over {_MAX_DTYPE_BYTES} bytes")
    fp = _fingerprint_bytes(fingerprint)
    length = geometry.block_bytes if payload_length is None else payload_length
    values = [MAGIC, FORMAT_VERSION, HEADER_SIZE, len(fp), fp, dtype, geometry.num_layers,
              geometry.outer_dim, geometry.page_size, geometry.inner_dim, geometry.block_bytes,
              sequence_hash, checksum, length, 0, 0, bytes(32)]
    try:
        fields = _FIELDS.pack(*values)
        if seal is not None:
            values[-2:] = [ENCRYPTED, bytes(seal)]
            fields = _FIELDS.pack(*values)
        elif tagger is not None:
            values[-3] = tagger.tag(object_identity(where, fields), sequence_hash, payload)
            fields = _FIELDS.pack(*values)
    except struct.error as exc:
        raise ValueError(f"object header field out of range: {exc}") from None
    return fields + _HEADER_HASH.pack(block_checksum(fields))


def decode_header(data) -> ObjectHeader:
    """Parse the header at the start of ``data`` (any bytes-like object). Raises
    :class:`ObjectMagicError`, :class:`ObjectVersionError`, :class:`ObjectTruncatedError` or
    :class:`ObjectCorruptError`."""
    view = memoryview(data).cast("B")
    head = bytes(view[:len(MAGIC)])
    if head != MAGIC[:len(head)] or not head:
        raise ObjectMagicError("not a kvstrata object (wrong magic)")
    if len(view) < len(MAGIC) + 2:
        raise ObjectTruncatedError(f"object of {len(view)} bytes ends inside its header")
    (version,) = struct.unpack_from("<H", view, len(MAGIC))
    if version != FORMAT_VERSION:
        raise ObjectVersionError(f"object format version {version}; this build reads "
                                 f"version {FORMAT_VERSION}")
    if len(view) < HEADER_SIZE:
        raise ObjectTruncatedError(f"object of {len(view)} bytes ends inside its "
                                   f"{HEADER_SIZE}-byte header")
    fields = view[:_FIELDS.size]
    (stored,) = _HEADER_HASH.unpack_from(view, _FIELDS.size)
    if block_checksum(fields) != stored:
        raise ObjectCorruptError("object header does not match its checksum")
    (_, version, header_size, fp_len, fp, dtype, layers, outer, page, inner, block_bytes,
     seq, checksum, length, tag, flags, seal) = _FIELDS.unpack(fields)
    if header_size != HEADER_SIZE or fp_len > MAX_FINGERPRINT_BYTES or flags & ~ENCRYPTED:
        raise ObjectCorruptError(f"object header: size {header_size}, fingerprint length "
                                 f"{fp_len}, flags {flags:#x}")
    try:
        fingerprint = fp[:fp_len].decode("utf-8")
        dtype_name = dtype.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError as exc:
        raise ObjectCorruptError(f"object header: undecodable text ({exc})") from None
    return ObjectHeader(version, header_size, fingerprint,
                        ObjectGeometry(layers, outer, page, inner, dtype_name, block_bytes),
                        seq, checksum, length, tag, flags, seal)


def open_object(data, *, fingerprint: str, geometry: ObjectGeometry, sequence_hash: int,
                tagger: BlockTagger | None = None,
                where: str = "") -> tuple[ObjectHeader, memoryview]:
    """Verify that ``data`` (a whole object) is block ``sequence_hash`` written under
    ``fingerprint`` with ``geometry``, that its payload hashes to the recorded xxh3-64 and,
    with ``tagger``, that it carries that key's tag for the key ``where`` it was read from
    (an object copied to another key, tenant or namespace fails). An encrypted object's
    payload is returned as it is (ciphertext), unchecked: :func:`decrypt_payload` checks it. Returns the header and a zero-copy view
    of the payload; raises an :class:`ObjectFormatError` subclass otherwise (see its
    ``failure_kind``)."""
    header = decode_header(data)
    if header.fingerprint != fingerprint:
        raise ForeignObjectError(f"object written under fingerprint {header.fingerprint!r}, "
                                 f"not {fingerprint!r}")
    if header.geometry != geometry:
        raise ForeignObjectError(f"object geometry {header.geometry} differs from {geometry}")
    if header.sequence_hash != sequence_hash:
        raise ForeignObjectError(f"object holds sequence hash {header.sequence_hash:#x}, not "
                                 f"{sequence_hash:#x}")
    if header.payload_length != geometry.block_bytes:
        raise ObjectCorruptError(f"object payload length {header.payload_length} != "
                                 f"block_bytes {geometry.block_bytes}")
    view = memoryview(data).cast("B")
    end = header.header_size + header.payload_length
    if len(view) < end:
        raise ObjectTruncatedError(f"object has {len(view) - header.header_size} of "
                                   f"{header.payload_length} payload bytes")
    if len(view) > end:
        raise ObjectCorruptError(f"object has {len(view) - end} bytes after its payload")
    payload = view[header.header_size:end]
    if header.encrypted:
        return header, payload               # ciphertext: decrypt_payload checks it
    actual = block_checksum(payload)
    if actual != header.checksum:
        raise ObjectCorruptError(f"payload xxh3-64 {actual:#018x} != recorded "
                                 f"{header.checksum:#018x}")
    if tagger is not None and tagger.tag(object_identity(where, view), sequence_hash,
                                         payload) != header.tag:
        raise ObjectForgedError("object's keyed tag does not match: not written under this "
                                "deployment's key")
    return header, payload


def object_identity(where: str, header) -> bytes:
    """What a tag or an encrypted payload is bound to: the object's key and the header's
    first :data:`TAG_OFFSET` bytes."""
    return where.encode() + bytes(memoryview(header).cast("B")[:TAG_OFFSET])


def decrypt_payload(data, header: ObjectHeader, payload, *, cipher, where: str, out) -> None:
    """Decrypt the encrypted ``payload`` of object ``data`` (read from key ``where``) into
    ``out`` and check its plaintext checksum; :class:`ObjectForgedError` if it was not
    sealed under this key for this object (``out`` zeroed), :class:`ObjectCorruptError` if
    the plaintext does not match (``out`` must then not be used)."""
    if cipher is None:
        raise ObjectForgedError("object is encrypted and encryption at rest is not set up "
                                "here")
    if not cipher.decrypt(object_identity(where, data), header.sequence_hash, payload,
                          header.seal, out):
        out[:] = 0                       # what failed its GCM tag is not left readable
        raise ObjectForgedError("encrypted object does not open under this deployment's key "
                                "for this key and header")
    actual = block_checksum(out)
    if actual != header.checksum:
        raise ObjectCorruptError(f"decrypted payload xxh3-64 {actual:#018x} != recorded "
                                 f"{header.checksum:#018x}")
