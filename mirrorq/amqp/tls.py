"""AMQPS: TLS for the AMQP listeners, in RabbitMQ's ``ssl_options`` vocabulary.

Two things, both free of sockets and clocks:

* :func:`server_context` builds the listener's :class:`ssl.SSLContext` from
  a node's ``ssl_options`` (node config, :mod:`mirrorq.node.config`)::

      cacertfile: /etc/mirrorq/ca.pem     # CAs a client certificate must chain to
      certfile: /etc/mirrorq/server.pem   # this node's certificate (chain)
      keyfile: /etc/mirrorq/server.key    # its private key
      password: ...                       # the key's passphrase, if it has one
      verify: verify_peer                 # verify_none (default) | verify_peer
      fail_if_no_peer_cert: true          # with verify_peer: refuse a client
                                          # without a certificate (default false)

  As RabbitMQ: ``verify_none`` asks no client certificate; ``verify_peer``
  asks one and refuses a client whose certificate does not chain to
  ``cacertfile``, but lets a client without one in unless
  ``fail_if_no_peer_cert`` is true.  Bad options raise
  :class:`TLSOptionsError` naming the option (``ssl_options.keyfile``...).
  TLS 1.2 is the lowest version offered.

* :class:`TLSSession` is one server-side TLS connection over memory BIOs
  (:class:`ssl.SSLObject`): the ThespianWatch listener
  (:mod:`mirrorq.amqp.listener`) feeds it what the socket read and writes
  what it returns; it never touches a socket.  Guarantees: plaintext handed
  to :meth:`TLSSession.send` before the handshake completed is encrypted and
  returned, in order, once it completes (in that ``receive``'s ``out``);
  every call returns all the ciphertext the TLS engine produced (handshake
  messages, alerts, session tickets, records, close_notify), so a shell
  that writes each ``out`` in order speaks correct TLS; a handshake or
  record failure comes back as ``error`` (with the alert, if any, in
  ``out``), never as an exception.

:func:`peer_info` gives RabbitMQ's TLS connection info items
(``ssl_protocol``, ``ssl_cipher``, ``peer_cert_subject``,
``peer_cert_issuer``, ``peer_cert_validity``) for either shell.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime

#: the ``ssl_options`` keys understood (RabbitMQ's names)
SSL_OPTION_KEYS = ("cacertfile", "certfile", "keyfile", "password", "verify", "fail_if_no_peer_cert")
VERIFY_MODES = ("verify_none", "verify_peer")
READ_CHUNK = 1 << 16


class TLSOptionsError(ValueError):
    """Bad ``ssl_options``: ``key`` is the option at fault (``ssl_options.certfile`` ...)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message)


def _file(opts: dict, name: str, required: bool) -> str | None:
    key = f"ssl_options.{name}"
    path = opts.get(name)
    if path is None or path == "":
        if required:
            raise TLSOptionsError(key, "missing (a PEM file path)")
        return None
    if not isinstance(path, str):
        raise TLSOptionsError(key, f"must be a file path, got {path!r}")
    if not os.path.isfile(path):
        raise TLSOptionsError(key, f"no such file: {path}")
    if not os.access(path, os.R_OK):
        raise TLSOptionsError(key, f"file is not readable: {path}")
    return path


def check_options(opts) -> dict:
    """Validate ``ssl_options`` (a mapping; keys :data:`SSL_OPTION_KEYS`) and
    return them with defaults filled in; raises :class:`TLSOptionsError`."""
    if not isinstance(opts, dict):
        raise TLSOptionsError("ssl_options", f"must be a mapping of {', '.join(SSL_OPTION_KEYS)}, got {opts!r}")
    for k in opts:
        if k not in SSL_OPTION_KEYS:
            raise TLSOptionsError(f"ssl_options.{k}", f"unknown option (known: {', '.join(SSL_OPTION_KEYS)})")
    verify = opts.get("verify", "verify_none")
    if verify not in VERIFY_MODES:
        raise TLSOptionsError("ssl_options.verify", f"must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    fail = opts.get("fail_if_no_peer_cert", False)
    if not isinstance(fail, bool):
        raise TLSOptionsError("ssl_options.fail_if_no_peer_cert", f"must be true or false, got {fail!r}")
    password = opts.get("password")
    if password is not None and not isinstance(password, str):
        raise TLSOptionsError("ssl_options.password", "must be a string")
    out = {"verify": verify, "fail_if_no_peer_cert": fail}
    for name in ("certfile", "keyfile"):
        out[name] = _file(opts, name, True)
    cacert = _file(opts, "cacertfile", verify == "verify_peer")
    if cacert is not None:
        out["cacertfile"] = cacert
    if password is not None:
        out["password"] = password
    return out


def server_context(opts: dict) -> ssl.SSLContext:
    """The listener's context for ``ssl_options`` (see the module docstring);
    raises :class:`TLSOptionsError` naming the option that is wrong."""
    o = check_options(opts)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # never OpenSSL's interactive prompt: an encrypted key without a password fails
        ctx.load_cert_chain(o["certfile"], o["keyfile"], password=o.get("password") or (lambda: b""))
    except ssl.SSLError as e:
        raise TLSOptionsError(
            "ssl_options.keyfile",
            f"cannot load the certificate {o['certfile']} with the key {o['keyfile']} "
            f"(not PEM, wrong password, or a key that does not match): {e.reason or e}",
        ) from None
    except OSError as e:
        raise TLSOptionsError("ssl_options.certfile", f"cannot read {o['certfile']} / {o['keyfile']}: {e}") from None
    if "cacertfile" in o:
        try:
            ctx.load_verify_locations(cafile=o["cacertfile"])
        except (ssl.SSLError, OSError) as e:
            raise TLSOptionsError(
                "ssl_options.cacertfile", f"cannot load CA certificates from {o['cacertfile']}: {e}"
            ) from None
    if o["verify"] == "verify_peer":
        ctx.verify_mode = ssl.CERT_REQUIRED if o["fail_if_no_peer_cert"] else ssl.CERT_OPTIONAL
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


# ---- connection info (RabbitMQ's items) ------------------------------------------------------------
_RDN_SHORT = {
    "commonName": "CN",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "localityName": "L",
    "stateOrProvinceName": "ST",
    "domainComponent": "DC",
    "userId": "UID",
    "streetAddress": "STREET",
    "emailAddress": "emailAddress",
}


def _rdn_escape(v: str) -> str:
    out = "".join("\\" + ch if ch in ',+"\\<>;=' else ch for ch in v)
    if out.startswith((" ", "#")):
        out = "\\" + out
    if out.endswith(" ") and not out.endswith("\\ "):
        out = out[:-1] + "\\ "
    return out


def format_name(name) -> str:
    """A certificate name as :meth:`ssl.SSLObject.getpeercert` gives it
    (a tuple of RDNs, each a tuple of (attribute, value)) as an RFC 4514
    string, most specific RDN first (``CN=client,O=Example``), as RabbitMQ's
    ``peer_cert_subject``."""
    rdns = []
    for rdn in name or ():
        rdns.append("+".join(f"{_RDN_SHORT.get(k, k)}={_rdn_escape(str(v))}" for k, v in rdn))
    return ",".join(reversed(rdns))


def _iso(cert_time: str) -> str:
    t = datetime.fromtimestamp(ssl.cert_time_to_seconds(cert_time), tz=UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def peer_info(obj) -> dict:
    """RabbitMQ's TLS items of an established connection (an
    :class:`ssl.SSLObject` or :class:`ssl.SSLSocket`): ``ssl_protocol``
    (``tlsv1.3``), ``ssl_cipher``, and, when the client presented a verified
    certificate, ``peer_cert_subject``, ``peer_cert_issuer`` and
    ``peer_cert_validity`` (``notBefore - notAfter``); absent items are None."""
    cipher = obj.cipher()
    info = {
        "ssl_protocol": (obj.version() or "").lower() or None,
        "ssl_cipher": cipher[0] if cipher else None,
        "peer_cert_subject": None,
        "peer_cert_issuer": None,
        "peer_cert_validity": None,
    }
    cert = obj.getpeercert()
    if cert:
        info["peer_cert_subject"] = format_name(cert.get("subject"))
        info["peer_cert_issuer"] = format_name(cert.get("issuer"))
        if cert.get("notBefore") and cert.get("notAfter"):
            info["peer_cert_validity"] = f"{_iso(cert['notBefore'])} - {_iso(cert['notAfter'])}"
    return info


# ---- one server-side TLS connection over memory BIOs ----------------------------------------------------
@dataclass
class TLSResult:
    """What one :meth:`TLSSession.receive` produced.  ``plain``: decrypted
    application bytes; ``out``: ciphertext to write to the socket;
    ``established``: the handshake completed in this call; ``closed``: the
    peer sent close_notify; ``error``: the TLS connection failed (what
    ``out`` holds is the alert for the peer; then close the socket)."""

    plain: bytes = b""
    out: bytes = b""
    established: bool = False
    closed: bool = False
    error: str = ""


class TLSSession:
    """One server-side TLS connection on memory BIOs (see the module docstring)."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self._in, self._out, server_side=True)
        self.established = False
        self.failed = ""
        self._pending = bytearray()  # plaintext sent before the handshake completed

    def receive(self, data: bytes) -> TLSResult:
        """Ciphertext from the socket (``b""``: the socket reached EOF)."""
        r = TLSResult()
        if self.failed:
            r.error = self.failed
            return r
        if data:
            self._in.write(data)
        else:
            self._in.write_eof()
        if not self.established:
            try:
                self.obj.do_handshake()
            except ssl.SSLWantReadError:
                r.out = self._out.read()
                return r
            except (ssl.SSLError, ValueError) as e:
                self.failed = r.error = f"TLS handshake failed: {_reason(e)}"
                r.out = self._out.read()
                return r
            self.established = r.established = True
            if self._pending:
                pending, self._pending = bytes(self._pending), bytearray()
                self._encrypt(pending)
        chunks = []
        while True:
            try:
                chunk = self.obj.read(READ_CHUNK)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                r.closed = True
                break
            except ssl.SSLError as e:
                self.failed = r.error = f"TLS error: {_reason(e)}"
                break
            if not chunk:
                r.closed = True
                break
            chunks.append(chunk)
        r.plain = b"".join(chunks)
        r.out = self._out.read()
        return r

    def send(self, plain: bytes) -> bytes:
        """Encrypt application bytes: the ciphertext to write (``b""`` while
        the handshake is not done: they are sent when it completes)."""
        if self.failed:
            return b""
        if not self.established:
            self._pending += plain
            return b""
        self._encrypt(plain)
        return self._out.read()

    def _encrypt(self, plain: bytes) -> None:
        view = memoryview(plain)
        while view:
            try:
                n = self.obj.write(view)
            except ssl.SSLError as e:
                self.failed = f"TLS error: {_reason(e)}"
                return
            view = view[n:]

    def close(self) -> bytes:
        """The close_notify alert to write before closing the socket (b"" if none)."""
        if not self.established or self.failed:
            return b""
        try:
            self.obj.unwrap()
        except (ssl.SSLWantReadError, ssl.SSLError, ValueError):
            pass
        return self._out.read()

    def peer_info(self) -> dict:
        return peer_info(self.obj)


def _reason(e: Exception) -> str:
    reason = getattr(e, "reason", None)
    verify = getattr(e, "verify_message", None)
    if verify:
        return f"{reason or e}: {verify}"
    return str(reason or e)
