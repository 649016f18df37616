"""Thespian's wire, closed to strangers: listen sockets bound to the node's
cluster address, and every inter-node message authenticated with the
cluster's shared secret *before* anything is unpickled.

Why a patch
-----------
Thespian's TCP transport (``thespian.system.transport.TCPTransport``) binds
every admin and actor listen socket to ``''`` (0.0.0.0) --
``THESPIAN_BASE_IPADDR`` only changes the *advertised* address -- and feeds
whatever arrives to ``pickle.loads``: anyone who reaches a port runs code.
Its public configuration (capabilities, environment) can change neither.
The least invasive fix is to replace two module-level seams, in-process,
before the actor system starts (:func:`install`; the node daemon calls it,
and the admin and every actor inherit it, as Thespian forks them from the
daemon process):

* ``TCPTransport.serializer`` (the module global whose ``dumps``/``loads``
  frame every message and every ACK) becomes :class:`AuthSerializer`:
  ``dumps`` prefixes the pickle with ``MQW1``, a count and one
  HMAC-SHA256 per known key; ``loads`` recomputes the HMAC over the pickled
  bytes with every key it holds and calls ``pickle.loads`` only on a match.
  Anything else raises :class:`RefusedMessage` before a byte is unpickled;
  Thespian then logs "Error deserializing received data" in the node's
  thespian.log, answers ACK+DATAERR and closes the socket.  The two
  constant ACK packets (``'ACK'``, ``'ACK+DATAERR'``) are recognised by
  their exact bytes and returned without unpickling.
* ``IPActorAddress.bindArgs`` returns the node's host instead of ``''``, so
  every listen socket of a node (admin, actors) binds the node's host only
  (``127.0.0.1`` for the local launcher), and an external client's binds
  its own address on the route to the node (:mod:`mirrorq.node.client`).

External tools (mirrorctl, tests, :mod:`mirrorq.node.client`,
:mod:`mirrorq.queues.client`) call :func:`install` too, with the
secrets they read from the cluster's data dir (:func:`use_data_dir`) or
from a copy of its secret file (:func:`use_secret_file`: a tool on another
host, ``mirrorctl --address``): a
process may hold several clusters' secrets (a test session does), and then
signs with all of them; a node holds one.

The secret: 32 random bytes, hex, in ``<data_dir>/cluster.secret`` (mode
0600), written by ``cluster start``; each node's ``node.yaml`` names it
(``secret_file``).  The daemon refuses to start without it, or when it is
readable by group or others.

Not covered: replay of a captured message (an attacker who can sniff
loopback already runs on the machine), and the ACK packets, which carry no
code and can at most make a sender think a message arrived.
"""

from __future__ import annotations

import hmac
import os
import pickle
import secrets
import stat
import threading
from pathlib import Path

MAGIC = b"MQW1"
MAC_LEN = 32
SECRET_FILE = "cluster.secret"


class RefusedMessage(Exception):
    """An inter-node message without a valid MAC under the cluster secret."""


def _control_packets() -> dict[bytes, str]:
    from thespian.system.transport.streamBuffer import ackDataErrPacket, ackPacket

    return {pickle.dumps(p): p for p in (ackPacket, ackDataErrPacket)}


class AuthSerializer:
    """``dumps``/``loads`` with an HMAC-SHA256 per key in front of the pickle."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.refused = 0
        self._control = _control_packets()
        self._lock = threading.Lock()

    def add_key(self, key: bytes) -> None:
        with self._lock:
            if key not in self.keys:
                if len(self.keys) >= 64:  # a long-lived tool: the oldest cluster's key goes
                    self.keys.pop(0)
                self.keys.append(key)

    def dumps(self, obj) -> bytes:
        p = pickle.dumps(obj)
        keys = list(self.keys)
        return MAGIC + bytes([len(keys)]) + b"".join(hmac.digest(k, p, "sha256") for k in keys) + p

    def loads(self, data: bytes):
        data = bytes(data)
        if data in self._control:
            return self._control[data]
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 1:
            self.refused += 1
            raise RefusedMessage("inter-node message without the cluster secret's MAC: dropped unread")
        n = data[len(MAGIC)]
        start = len(MAGIC) + 1 + n * MAC_LEN
        macs = [data[len(MAGIC) + 1 + i * MAC_LEN : len(MAGIC) + 1 + (i + 1) * MAC_LEN] for i in range(n)]
        payload = data[start:]
        for k in list(self.keys):
            want = hmac.digest(k, payload, "sha256")
            if any(hmac.compare_digest(want, m) for m in macs):
                return pickle.loads(payload)
        self.refused += 1
        raise RefusedMessage("inter-node message with a wrong MAC (not this cluster's secret): dropped unread")


_SERIALIZER: AuthSerializer | None = None
_BIND_HOST: list[str | None] = [None]


def serializer() -> AuthSerializer:
    global _SERIALIZER
    if _SERIALIZER is None:
        _SERIALIZER = AuthSerializer()
    return _SERIALIZER


def install(secret: bytes | None = None, bind_host: str | None = None) -> AuthSerializer:
    """Put the authenticated serializer (with ``secret`` added) and, when
    ``bind_host`` is given, the bind-address patch into Thespian's TCP
    transport of this process.  Idempotent; call it before any actor system
    or client starts (those forked later inherit it)."""
    import thespian.system.transport.TCPTransport as tcp
    from thespian.system.transport.IPBase import IPActorAddress

    ser = serializer()
    if secret:
        ser.add_key(secret)
    tcp.serializer = ser
    if bind_host:
        _BIND_HOST[0] = bind_host
        if not getattr(IPActorAddress, "_mirrorq_bind_patched", False):

            def bindArgs(self):  # noqa: N802 -- Thespian's name
                host, port = self.bindname[0], self.bindname[1]
                if host in ("", "0.0.0.0") and _BIND_HOST[0]:
                    host = _BIND_HOST[0]
                return ((host, port),)

            IPActorAddress.bindArgs = property(bindArgs)
            IPActorAddress._mirrorq_bind_patched = True
    return ser


def create_secret(data_dir: str | os.PathLike) -> Path:
    """``<data_dir>/cluster.secret`` (0600): created once, kept afterwards."""
    path = Path(data_dir) / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def read_secret(path: str | os.PathLike, strict: bool = True) -> bytes:
    """The secret in ``path``; with ``strict``, refuse a file others can read."""
    st = os.stat(path)
    if strict and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(
            f"cluster secret {path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it"
        )
    text = Path(path).read_text().strip()
    if len(text) < 32:
        raise ValueError(f"cluster secret {path} is too short")
    return text.encode()


ENV = "MIRRORQ_SECRET_FILE"


def use_data_dir(data_dir: str | os.PathLike, bind_host: str = "127.0.0.1") -> bool:
    """For tools: install the secret of the cluster in ``data_dir`` if there
    is one, and add its path to ``$MIRRORQ_SECRET_FILE`` (``os.pathsep``
    separated) so that processes this one starts (a bench's spawned load
    process) sign with it too."""
    path = Path(data_dir) / SECRET_FILE
    if not path.exists():
        install(bind_host=bind_host)
        return False
    install(bind_host=bind_host)
    use_secret_file(path)
    return True


def use_secret_file(path: str | os.PathLike) -> None:
    """For tools: sign with the secret in ``path`` too (a copy of a cluster's
    ``secret_file``), and name it in ``$MIRRORQ_SECRET_FILE`` for the
    processes this one starts.  Raises OSError/ValueError for a bad file."""
    install(read_secret(path, strict=False))
    known = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    if str(path) not in known:
        os.environ[ENV] = os.pathsep.join(known + [str(path)])


def use_environment(bind_host: str | None = None) -> None:
    """Install every secret named in ``$MIRRORQ_SECRET_FILE`` (missing files are skipped)."""
    install(bind_host=bind_host)
    for p in os.environ.get(ENV, "").split(os.pathsep):
        if p and os.path.exists(p):
            install(read_secret(p, strict=False))
