"""Sink spec strings (``kvstrata replay --events SPEC``) and :func:`make_publisher`.

=====================================================  ==========================================
spec                                                   sink
=====================================================  ==========================================
``none``                                               discard (events still numbered/snapshots)
``callback``                                           in-process: ``callback=fn`` option, else
                                                       an in-memory list (``publisher.sink``)
``jsonl:PATH``                                         kvstrata JSON lines appended to PATH
``dynamo-json:PATH``                                   Dynamo RouterEvent JSON lines to PATH
``nats://HOST:PORT[/SUBJECT][?format=kvstrata|dynamo   NATS (default subject ``kvstrata.events``;
&jetstream=1&stream=NAME&snapshots=0&direct=0          ``per_worker=1``: on
&per_worker=1]``                                       ``SUBJECT.worker.<worker id>``)
``zmq://tcp://HOST:PORT[?topic=T&layout=map|array      ZMQ PUB, vLLM KVEventBatch msgpack
&connect=1]``  (also ``zmq://ipc://...``)
=====================================================  ==========================================
"""

from __future__ import annotations

import os

from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import SplitResult, parse_qsl, urlsplit

from kvstrata.paths import path_problem, writable_file_problem
from kvstrata.redact import redacted
from kvstrata.events.publisher import EventPublisher, Sink

DEFAULT_SUBJECT = "kvstrata.events"

_PARAMS = {
    "nats": {"format", "jetstream", "stream", "snapshots", "direct", "per_worker"},
    "zmq": {"topic", "layout", "connect", "hwm"},
}


class SinkSpecError(ValueError):
    """A sink spec string is malformed; the message names the problem and the accepted forms."""


@dataclass(frozen=True)
class SinkSpec:
    kind: str  # none | callback | jsonl | dynamo-json | nats | zmq
    target: str = ""  # path, nats server URL or zmq endpoint
    subject: str = ""  # nats only
    params: dict[str, str] = field(default_factory=dict)


_FORMS = "none, callback, jsonl:PATH, dynamo-json:PATH, nats://HOST:PORT/SUBJECT[?format=kvstrata|dynamo&jetstream=1], zmq://tcp://HOST:PORT[?topic=T&layout=map|array]"



def _shown(spec: str) -> str:
    """``spec`` as an error may show it: without credentials (its query holds options)."""
    return redacted(spec, query=False)

def _flag(spec: str, params: dict[str, str], name: str) -> bool:
    value = params.get(name, "0").lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise SinkSpecError(f"sink spec {_shown(spec)!r}: {name}={value!r} is not a boolean (use 1 or 0)")


def _query(spec: str, kind: str, query: str) -> dict[str, str]:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise SinkSpecError(f"sink spec {_shown(spec)!r}: malformed query string {query!r}") from None
    params = dict(pairs)
    unknown = set(params) - _PARAMS[kind]
    if unknown:
        raise SinkSpecError(
            f"sink spec {_shown(spec)!r}: unknown option(s) {', '.join(sorted(unknown))} for {kind} "
            f"(accepted: {', '.join(sorted(_PARAMS[kind]))})"
        )
    return params


def parse_sink_spec(spec: str) -> SinkSpec:
    """Parse a sink spec string; raises :class:`SinkSpecError` naming what is wrong."""
    if not isinstance(spec, str) or not spec.strip():
        raise SinkSpecError(f"empty sink spec (expected one of: {_FORMS})")
    spec = spec.strip()
    if spec in ("none", "callback"):
        return SinkSpec(spec)
    for prefix in ("jsonl:", "dynamo-json:"):
        if spec.startswith(prefix):
            path = spec[len(prefix) :]
            if not path:
                raise SinkSpecError(f"sink spec {_shown(spec)!r}: missing file path after {prefix!r}")
            if path_problem(path):
                raise SinkSpecError(f"sink spec {_shown(spec)!r:.80}: the path {path_problem(path)}")
            return SinkSpec(prefix[:-1], path)
    if spec.startswith("nats://"):
        parts, port = nats_url_parts(spec, f"sink spec {_shown(spec)!r}")
        subject = parts.path.lstrip("/") or DEFAULT_SUBJECT
        from kvstrata.events.sinks import check_subject

        try:
            check_subject(subject)
        except ValueError as exc:
            raise SinkSpecError(f"sink spec {_shown(spec)!r}: {exc}") from None
        params = _query(spec, "nats", parts.query)
        if params.get("format", "kvstrata") not in ("kvstrata", "dynamo"):
            raise SinkSpecError(f"sink spec {_shown(spec)!r}: format must be kvstrata or dynamo, got {params['format']!r}")
        _flag(spec, params, "jetstream")
        _flag(spec, params, "snapshots")
        _flag(spec, params, "direct")
        if _flag(spec, params, "per_worker") and _flag(spec, params, "jetstream"):
            raise SinkSpecError(f"sink spec {_shown(spec)!r}: per_worker=1 publishes on core NATS "
                                f"only (not with jetstream=1)")
        # kept as written (still percent-encoded): user:password@, or a token alone as token@
        userinfo, at, _ = parts.netloc.rpartition("@")
        auth = f"{userinfo}{at}" if userinfo else ""
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        url = f"nats://{auth}{host}:{port or 4222}"
        return SinkSpec("nats", url, subject, params)
    if spec.startswith("zmq://"):
        rest = spec[len("zmq://") :]
        endpoint, _, query = rest.partition("?")
        scheme, sep, addr = endpoint.partition("://")
        if not sep or scheme not in ("tcp", "ipc", "inproc") or not addr:
            raise SinkSpecError(f"sink spec {_shown(spec)!r}: expected zmq://tcp://HOST:PORT, zmq://ipc://PATH or zmq://inproc://NAME")
        if scheme == "tcp":
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise SinkSpecError(f"sink spec {_shown(spec)!r}: tcp endpoint needs HOST:PORT with a "
                                    f"port in 1..65535")
        params = _query(spec, "zmq", query)
        if params.get("layout", "map") not in ("map", "array"):
            raise SinkSpecError(f"sink spec {_shown(spec)!r}: layout must be map or array, got {params['layout']!r}")
        _flag(spec, params, "connect")
        if "hwm" in params and not (params["hwm"].isdigit() and len(params["hwm"]) <= 9):
            raise SinkSpecError(f"sink spec {_shown(spec)!r:.80}: hwm must be an integer of at most "
                                f"9 digits (messages queued per subscriber)")
        return SinkSpec("zmq", endpoint, "", params)
    raise SinkSpecError(f"unknown sink spec {_shown(spec)!r} (expected one of: {_FORMS})")


def nats_url_parts(url: str, what: str) -> tuple[SplitResult, int | None]:
    """``url`` (``nats://[user:password@]HOST[:PORT][/...]``) split, and its port (None:
    NATS's default); :class:`SinkSpecError` naming ``what`` if it is not such a URL (a
    malformed IPv6 host, a port that is not a number in 1..65535, no host)."""
    if not isinstance(url, str) or not url.startswith("nats://"):
        raise SinkSpecError(f"{what}: expected nats://HOST:PORT")
    try:
        parts = urlsplit(url)
    except ValueError as exc:                       # e.g. "nats://[": a bad IPv6 host
        raise SinkSpecError(f"{what}: {exc}") from None
    try:
        port = parts.port
    except ValueError:
        raise SinkSpecError(f"{what}: the port is not a number in 1..65535") from None
    if port == 0:
        raise SinkSpecError(f"{what}: the port is not a number in 1..65535")
    if not parts.hostname:
        raise SinkSpecError(f"{what}: missing host (nats://HOST:PORT)")
    return parts, port


def sink_problem(spec: str, dp_rank: int = 0) -> str | None:
    """What stops a sink spec from being used here, found without opening anything: the
    spec's form (:func:`parse_sink_spec`), for a file sink whether the file can be written
    (its directory exists, it is not a directory, it is writable, it is not a link, another
    user's file or one others can write: :func:`~.sinks.event_file_problem`), and the file or bound
    port of data-parallel engine ``dp_rank`` (see :func:`make_sink`). None if nothing."""
    try:
        s = parse_sink_spec(spec)
        if s.kind == "zmq" and not _flag("", s.params, "connect"):
            engine_address(s.target, dp_rank)
    except (SinkSpecError, ValueError) as exc:
        return str(exc) if isinstance(exc, SinkSpecError) else f"zmq endpoint {exc}"
    if dp_rank and s.kind == "nats" and s.params.get("format", "kvstrata") == "kvstrata":
        return (f"sink spec {_shown(spec)!r:.80}: kvstrata's event format carries no data-parallel "
                f"rank, so engine {dp_rank} would publish as engine 0's worker on the same "
                f"subject; use format=dynamo (it carries dp_rank) or a file sink")
    if s.kind in ("jsonl", "dynamo-json"):
        from kvstrata.events.sinks import event_file_problem

        target = _engine_file(s.target, dp_rank)
        problem = writable_file_problem(target)
        if problem:
            return f"sink spec {_shown(spec)!r:.80}: {target} {problem}"
        problem = event_file_problem(target)
        if problem:
            return f"sink spec {_shown(spec)!r:.80}: {target}: {problem}"
    return None


def make_sink(spec: str | SinkSpec, callback: Callable | None = None,
              dp_rank: int = 0) -> Sink:
    """Build (not open) the sink a spec describes. ``dp_rank``: the data-parallel rank of
    the engine publishing (stamped on events whose format carries one); the engines of
    one server then do not share a file or a bound endpoint: rank ``k > 0`` writes
    ``<stem>.dp<k><suffix>`` and binds a tcp port ``k`` above the spec's (as vLLM offsets
    its own tcp event endpoints; ``-dp<k>`` after an ipc or inproc name)."""
    from kvstrata.events import sinks

    s = parse_sink_spec(spec) if isinstance(spec, str) else spec
    if s.kind == "none":
        return sinks.NullSink()
    if s.kind == "callback":
        return sinks.CallbackSink(callback) if callback is not None else sinks.MemorySink()
    if s.kind in ("jsonl", "dynamo-json"):
        return sinks.JsonlFileSink(_engine_file(s.target, dp_rank),
                                   "kvstrata" if s.kind == "jsonl" else "dynamo",
                                   dp_rank=dp_rank)
    if s.kind == "nats":
        return sinks.NatsSink(
            s.target,
            s.subject,
            format=s.params.get("format", "kvstrata"),
            jetstream=_flag("", s.params, "jetstream"),
            stream=s.params.get("stream"),
            serve_snapshots=_flag("", {"snapshots": s.params.get("snapshots", "1")}, "snapshots"),
            direct=_flag("", {"direct": s.params.get("direct", "1")}, "direct"),
            per_worker=_flag("", s.params, "per_worker"),
            dp_rank=dp_rank,
        )
    if s.kind == "zmq":
        connect = _flag("", s.params, "connect")
        try:
            endpoint = s.target if connect else engine_address(s.target, dp_rank)
        except ValueError as exc:
            raise SinkSpecError(f"zmq endpoint {exc}") from None
        return sinks.ZmqSink(
            endpoint,
            topic=s.params.get("topic", ""),
            layout=s.params.get("layout", "map"),
            connect=connect,
            hwm=int(s.params.get("hwm", 100_000)),
            dp_rank=dp_rank,
        )
    raise SinkSpecError(f"unknown sink kind {s.kind!r}")


def _engine_file(path: str, dp_rank: int) -> str:
    """The file data-parallel engine ``dp_rank`` writes for ``path`` (see make_sink)."""
    if not dp_rank:
        return path
    root, suffix = os.path.splitext(path)
    return f"{root}.dp{dp_rank}{suffix}"


def engine_address(address: str, dp_rank: int) -> str:
    """The address data-parallel engine ``dp_rank`` binds for ``address`` (a zmq endpoint,
    an export's control address): a tcp port ``dp_rank`` above it, ``-dp<k>`` after any
    other (ipc or inproc) name. ``ValueError`` where the port would pass 65535."""
    if not dp_rank:
        return address
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        return f"{address}-dp{dp_rank}"
    host, _, port = rest.rpartition(":")
    if int(port) + dp_rank > 65535:
        raise ValueError(f"{address}: data-parallel engine {dp_rank} would bind port "
                         f"{int(port) + dp_rank}, above 65535")
    return f"tcp://{host}:{int(port) + dp_rank}"


def sink_specs(value: object, problems: list[str]) -> tuple[str, ...]:
    """An engine config's ``events`` (one sink spec or a list of them), checked with
    :func:`sink_problem`; what is wrong is added to ``problems`` (and left out)."""
    if isinstance(value, str):
        value = (value,) if value else ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(e, str) and e
                                                       for e in value):
        problems.append(f"events must be a sink spec or a list of them, got {value!r:.80}")
        return ()
    good = []
    for spec_text in value:
        problem = sink_problem(spec_text)
        if problem:
            problems.append(f"events: {problem}")
        else:
            good.append(spec_text)
    return tuple(good)


def make_publisher(spec: str, *, start: bool = True, callback: Callable | None = None,
                   dp_rank: int = 0, **options: Any) -> EventPublisher:
    """An :class:`EventPublisher` for a sink spec (``dp_rank``: see :func:`make_sink`),
    started unless ``start=False``.

    ``options`` go to :class:`EventPublisher` (``max_batch``, ``max_delay``, ``buffer_events``,
    ``worker_id``, ``keep_tokens``). Wire it with ``registry.add_observer(publisher)`` and call
    ``publisher.close()`` at the end.
    """
    publisher = EventPublisher(make_sink(spec, callback=callback, dp_rank=dp_rank), **options)
    return publisher.start() if start else publisher
