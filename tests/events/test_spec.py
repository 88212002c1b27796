import pytest

from kvstrata.events import SinkSpecError, make_publisher, parse_sink_spec
from kvstrata.events.sinks import JsonlFileSink, MemorySink, NatsSink, NullSink, ZmqSink
from kvstrata.events.spec import make_sink


@pytest.mark.parametrize(
    "spec,kind,target,subject,params",
    [
        ("none", "none", "", "", {}),
        ("callback", "callback", "", "", {}),
        ("jsonl:/tmp/x.jsonl", "jsonl", "/tmp/x.jsonl", "", {}),
        ("dynamo-json:rel/path.jsonl", "dynamo-json", "rel/path.jsonl", "", {}),
        ("nats://127.0.0.1:4222/kv.events", "nats", "nats://127.0.0.1:4222", "kv.events", {}),
        ("nats://host", "nats", "nats://host:4222", "kvstrata.events", {}),
        (
            "nats://127.0.0.1:5000/a.b?format=dynamo&jetstream=1",
            "nats",
            "nats://127.0.0.1:5000",
            "a.b",
            {"format": "dynamo", "jetstream": "1"},
        ),
        ("nats://h:1/x?direct=0", "nats", "nats://h:1", "x", {"direct": "0"}),
        ("nats://tok@h:1/x", "nats", "nats://tok@h:1", "x", {}),            # a token alone
        ("nats://u:p%40ss@h/x", "nats", "nats://u:p%40ss@h:4222", "x", {}),
        ("nats://[::1]:4222/x", "nats", "nats://[::1]:4222", "x", {}),
        ("zmq://tcp://127.0.0.1:5557", "zmq", "tcp://127.0.0.1:5557", "", {}),
        ("zmq://tcp://*:5557?topic=kv-events&layout=array", "zmq", "tcp://*:5557", "", {"topic": "kv-events", "layout": "array"}),
        ("zmq://ipc:///tmp/kv.sock", "zmq", "ipc:///tmp/kv.sock", "", {}),
    ],
)
def test_parse_good_specs(spec, kind, target, subject, params):
    s = parse_sink_spec(spec)
    assert (s.kind, s.target, s.subject, s.params) == (kind, target, subject, params)


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("kafka://x", "unknown sink spec"),
        ("jsonl:", "missing file path"),
        ("nats://:4222/x", "missing host"),
        ("nats://h:abc/x", "port is not a number"),
        ("nats://h:4222/a.*", "invalid NATS subject"),
        ("nats://h:4222/a..b", "invalid NATS subject"),
        ("nats://h:4222/x?format=avro", "format must be"),
        ("nats://h:4222/x?jetstream=maybe", "not a boolean"),
        ("nats://h:4222/x?colour=red", "unknown option"),
        ("zmq://127.0.0.1:5557", "expected zmq://tcp"),
        ("zmq://tcp://127.0.0.1", "port in 1..65535"),
        ("zmq://tcp://127.0.0.1:99999", "port in 1..65535"),
        ("jsonl:/tmp/a\x00b", "contains a NUL byte"),
        ("zmq://tcp://h:1?layout=columns", "layout must be"),
        ("zmq://tcp://h:1?hwm=x", "hwm must be"),
    ],
)
def test_parse_bad_specs_name_the_problem(spec, needle):
    with pytest.raises(SinkSpecError, match=needle.replace("*", r"\*")):
        parse_sink_spec(spec)


def test_spec_error_is_a_value_error():
    assert issubclass(SinkSpecError, ValueError)


def test_make_sink_kinds(tmp_path):
    assert isinstance(make_sink("none"), NullSink)
    assert isinstance(make_sink("callback"), MemorySink)
    assert isinstance(make_sink(f"jsonl:{tmp_path}/a.jsonl"), JsonlFileSink)
    assert make_sink(f"dynamo-json:{tmp_path}/a.jsonl").format == "dynamo"
    nats = make_sink("nats://127.0.0.1:1/x.y?jetstream=1&format=dynamo")
    assert isinstance(nats, NatsSink) and nats.jetstream and nats.format == "dynamo" and nats.stream == "KVSTRATA_X_Y"
    assert not nats.direct  # JetStream waits for acks: always through nats-py
    assert make_sink("nats://127.0.0.1:1/x.y").direct and not make_sink("nats://127.0.0.1:1/x.y?direct=0").direct
    z = make_sink("zmq://tcp://127.0.0.1:1?layout=array&connect=1")
    assert isinstance(z, ZmqSink) and z.layout == "array" and z.connect


def test_make_publisher_file_directory_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_publisher(f"jsonl:{tmp_path}/nope/a.jsonl")


def test_make_publisher_callback_function():
    got = []
    pub = make_publisher("callback", callback=got.append, worker_id=3)
    assert pub.identity.worker_id == 3
    pub.close()


def test_per_worker_nats_sinks_publish_on_their_worker_subject_and_never_show_credentials():
    from kvstrata.redact import redacted
    from kvstrata.events.spec import SinkSpecError, make_sink, parse_sink_spec

    with pytest.raises(SinkSpecError, match="per_worker"):
        parse_sink_spec("nats://127.0.0.1:4222/kv.ev?per_worker=1&jetstream=1")
    sink = make_sink(parse_sink_spec("nats://user:s3cret@127.0.0.1:4222/kv.ev?per_worker=1"))
    assert sink.per_worker and sink.publish_subject == "kv.ev"   # until the publisher opens it
    assert "s3cret" not in sink.describe() and "***@127.0.0.1:4222" in sink.describe()
    assert redacted("nats://tok@h:1/x") == "nats://***@h:1/x"
    assert redacted("nats://h:1/x") == "nats://h:1/x"


@pytest.mark.parametrize("spec", [
    "nats://indexer:NATS-PASSWORD@127.0.0.1:4222/kv?format=Dynamo",      # a bad option
    "nats://indexer:NATS-PASSWORD@127.0.0.1:4222/kv?jetstream=1&per_worker=1",
    "nats://indexer:NATS-PASSWORD@/kv",                                  # no host
    "nats://indexer:NATS-PASSWORD@127.0.0.1:99999/kv",                   # a bad port
    "nats://indexer:NATS-PASSWORD@127.0.0.1:4222/kv?nonsense=1",
    "nats://indexer:NATS/PASSWORD@127.0.0.1:4222/kv?format=Dynamo",      # a "/" in it
])
def test_a_refused_sink_spec_never_shows_its_password(spec):
    from kvstrata.events.spec import SinkSpecError, parse_sink_spec, sink_problem

    with pytest.raises(SinkSpecError) as refused:
        parse_sink_spec(spec)
    for shown in (str(refused.value), sink_problem(spec, dp_rank=1) or ""):
        assert "PASSWORD" not in shown
    assert "***@" in str(refused.value)


def test_redacted_takes_credentials_and_signed_queries_out():
    from kvstrata.redact import redacted

    assert redacted("http://key:secret@h:9000/b") == "http://***@h:9000/b"
    assert redacted("http://h:9000/b?X-Amz-Signature=abc") == "http://h:9000/b?***"
    assert redacted("http://h:9000?sig=abc") == "http://h:9000?***"
    assert redacted("nats://u:p@h:1/s?format=dynamo", query=False) == "nats://***@h:1/s?format=dynamo"
    assert redacted("user:pw@host/x") == "***@host/x"
    assert redacted("http://user:s3cr/etPW@host:9000/b") == "http://***@host:9000/b"   # base64


@pytest.mark.parametrize("password", ["s3cr?tPW", "s3cr#tPW", "s3cr?t#P/W"])
def test_a_password_holding_a_query_or_fragment_mark_is_not_shown(password):
    """The credentials were looked for before the first "?" or "#" only: a password typed
    without percent-encoding came back in the message saying what was wrong with it."""
    from kvstrata.redact import redacted

    for url in (f"nats://indexer:{password}@127.0.0.1:4222/kv",
                f"nats://indexer:{password}@127.0.0.1:99999/kv"):
        shown = redacted(url)
        assert "s3cr" not in shown and shown.startswith("nats://***@127.0.0.1")
    with pytest.raises(ValueError) as refused:
        parse_sink_spec(f"nats://indexer:{password}@127.0.0.1:99999/kv")
    assert "s3cr" not in str(refused.value)
