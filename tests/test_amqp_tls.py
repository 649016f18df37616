"""AMQPS without sockets: ssl_options validation (node config errors name the
key), the sans-IO TLSSession against a client SSLObject in memory, and the
front end's TLS connection info.  Certificates come from a test CA made
here (trustme)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from mirrorq.amqp.tls import (
    TLSOptionsError,
    TLSSession,
    check_options,
    format_name,
    server_context,
)
from mirrorq.node.config import ConfigError, from_mapping, load

trustme = pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate (127.0.0.1, localhost) and a client certificate, as PEM files."""
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA(organization_name="mirrorq test CA")
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@example.org", common_name="tls-client", organization_name="mirrorq tests")
    files = {
        "ca": d / "ca.pem",
        "cert": d / "server.pem",
        "key": d / "server.key",
        "client_cert": d / "client.pem",
        "client_key": d / "client.key",
    }
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.cert_chain_pems[0].write_to_path(str(files["cert"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    client.cert_chain_pems[0].write_to_path(str(files["client_cert"]))
    client.private_key_pem.write_to_path(str(files["client_key"]))
    other = trustme.CA().issue_cert("127.0.0.1")  # a key that belongs to another certificate
    files["other_key"] = d / "other.key"
    other.private_key_pem.write_to_path(str(files["other_key"]))
    files["garbage"] = d / "garbage.pem"
    files["garbage"].write_text("not a PEM file\n")
    return {k: str(v) for k, v in files.items()}


def _opts(pki, **kw):
    o = {"certfile": pki["cert"], "keyfile": pki["key"], "cacertfile": pki["ca"]}
    o.update(kw)
    return {k: v for k, v in o.items() if v is not None}


# ---- node config -------------------------------------------------------------------------------------
def test_config_round_trip_with_amqps(pki, tmp_path):
    cfg = from_mapping(
        {"name": "n", "amqps_port": 5671, "ssl_options": _opts(pki, verify="verify_peer", fail_if_no_peer_cert=True)},
        "x.yaml",
    )
    assert cfg.amqps_port == 5671
    assert cfg.ssl_options == {
        "certfile": pki["cert"],
        "keyfile": pki["key"],
        "cacertfile": pki["ca"],
        "verify": "verify_peer",
        "fail_if_no_peer_cert": True,
    }
    cfg.dump(tmp_path / "n.yaml")
    assert load(tmp_path / "n.yaml") == cfg
    plain = from_mapping({"name": "n"})
    assert plain.amqps_port == 0 and plain.ssl_options == {}
    assert "amqps_port" not in plain.to_dict()  # a plain node's file is unchanged


@pytest.mark.parametrize(
    "amqps, opts, key, text",
    [
        (5671, None, "ssl_options", "needs at least certfile and keyfile"),
        ("5671", {}, "amqps_port", "port number"),
        (5672, {}, "amqps_port", "must differ from admin_port"),  # the AMQP port
        (19500, {}, "amqps_port", "must differ"),  # the admin port
        (15672, {}, "amqps_port", "must differ"),  # the management port
        (5671, {"certfile": None}, "ssl_options.certfile", "missing"),
        (5671, {"keyfile": None}, "ssl_options.keyfile", "missing"),
        (5671, {"certfile": "/nonexistent/server.pem"}, "ssl_options.certfile", "no such file"),
        (5671, {"keyfile": "/nonexistent/server.key"}, "ssl_options.keyfile", "no such file"),
        (5671, {"cacertfile": "/nonexistent/ca.pem"}, "ssl_options.cacertfile", "no such file"),
        (5671, {"keyfile": "@other_key"}, "ssl_options.keyfile", "does not match"),
        (5671, {"keyfile": "@garbage"}, "ssl_options.keyfile", "cannot load"),
        (5671, {"cacertfile": "@garbage"}, "ssl_options.cacertfile", "cannot load CA"),
        (5671, {"verify": "verify_all"}, "ssl_options.verify", "verify_none, verify_peer"),
        (5671, {"verify": "verify_peer", "cacertfile": None}, "ssl_options.cacertfile", "missing"),
        (5671, {"fail_if_no_peer_cert": "yes"}, "ssl_options.fail_if_no_peer_cert", "true or false"),
        (5671, {"depth": 2}, "ssl_options.depth", "unknown option"),
    ],
)
def test_bad_amqps_config_names_the_key(pki, amqps, opts, key, text):
    raw = {"name": "n", "amqps_port": amqps}
    if opts is not None:
        raw["ssl_options"] = _opts(
            pki, **{k: pki[v[1:]] if isinstance(v, str) and v.startswith("@") else v for k, v in opts.items()}
        )
    with pytest.raises(ConfigError) as e:
        from_mapping(raw, "node.yaml")
    assert e.value.key == key, str(e.value)
    assert text in str(e.value) and "node.yaml" in str(e.value)


def test_unreadable_key_is_named(pki, tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    key = tmp_path / "locked.key"
    key.write_bytes(Path(pki["key"]).read_bytes())
    key.chmod(0)
    with pytest.raises(ConfigError) as e:
        from_mapping({"name": "n", "amqps_port": 5671, "ssl_options": _opts(pki, keyfile=str(key))})
    assert e.value.key == "ssl_options.keyfile" and "not readable" in str(e.value)


def test_verify_modes_map_to_rabbitmq_semantics(pki):
    assert server_context(_opts(pki)).verify_mode == ssl.CERT_NONE
    assert server_context(_opts(pki, verify="verify_peer")).verify_mode == ssl.CERT_OPTIONAL
    assert server_context(_opts(pki, verify="verify_peer", fail_if_no_peer_cert=True)).verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(TLSOptionsError) as e:
        check_options(["certfile"])
    assert e.value.key == "ssl_options"


# ---- TLSSession over memory BIOs ----------------------------------------------------------------------
class _MemClient:
    """A TLS client on memory BIOs (the test's side of the wire)."""

    def __init__(self, pki, cert: bool):
        ctx = ssl.create_default_context(cafile=pki["ca"])
        if cert:
            ctx.load_cert_chain(pki["client_cert"], pki["client_key"])
        self.inb, self.outb = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.inb, self.outb, server_hostname="localhost")
        self.error: Exception | None = None

    def step(self) -> bytes:
        try:
            self.obj.do_handshake()
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLError as e:
            self.error = e
        return self.outb.read()


def _handshake(server: TLSSession, client: _MemClient, rounds: int = 6):
    """Pump bytes both ways until both sides are done or failed; what the server's receives returned."""
    results = []
    data = client.step()
    for _ in range(rounds):
        r = server.receive(data)
        results.append(r)
        if r.out:
            client.inb.write(r.out)
        data = client.step()
        if (server.established or server.failed) and not data:
            break
    return results


def test_session_handshake_then_application_data_both_ways(pki):
    server = TLSSession(server_context(_opts(pki)))
    client = _MemClient(pki, cert=False)
    early = server.send(b"held until the handshake is done")
    assert early == b""  # plaintext before the handshake is held, not lost
    results = _handshake(server, client)
    assert server.established and client.error is None
    assert sum(r.established for r in results) == 1
    # what was held came out encrypted with the handshake's last flight
    assert client.obj.read(1024) == b"held until the handshake is done"
    client.obj.write(b"AMQP\x00\x00\x09\x01")
    r = server.receive(client.outb.read())
    assert r.plain == b"AMQP\x00\x00\x09\x01" and not r.error and not r.closed
    client.inb.write(server.send(b"x" * 100_000))  # larger than a TLS record
    got = b""
    while len(got) < 100_000:
        got += client.obj.read(1 << 16)
    assert got == b"x" * 100_000
    info = server.peer_info()
    assert info["ssl_protocol"] in ("tlsv1.2", "tlsv1.3") and info["ssl_cipher"]
    assert info["peer_cert_subject"] is None  # verify_none asks no certificate
    # close: the server's close_notify reaches the client; the client's close is seen
    client.inb.write(server.close())
    assert client.obj.read(10) == b""  # SSLObject's answer to a close_notify


def test_session_reports_the_peer_close(pki):
    server = TLSSession(server_context(_opts(pki)))
    client = _MemClient(pki, cert=False)
    _handshake(server, client)
    try:
        client.obj.unwrap()
    except ssl.SSLWantReadError:
        pass
    r = server.receive(client.outb.read())
    assert r.closed and not r.error


def test_verify_peer_reports_the_client_certificate(pki):
    server = TLSSession(server_context(_opts(pki, verify="verify_peer", fail_if_no_peer_cert=True)))
    client = _MemClient(pki, cert=True)
    _handshake(server, client)
    assert server.established and client.error is None
    client.obj.write(b"ping")  # TLS 1.3: the server sees the client's certificate verdict with data
    assert server.receive(client.outb.read()).plain == b"ping"
    info = server.peer_info()
    subject = info["peer_cert_subject"]  # trustme adds an OU of its own between CN and O
    assert subject.startswith("CN=tls-client,OU=") and subject.endswith(",O=mirrorq tests"), info
    assert "mirrorq test CA" in info["peer_cert_issuer"]
    assert " - " in info["peer_cert_validity"]


def test_fail_if_no_peer_cert_refuses_a_client_without_one(pki):
    server = TLSSession(server_context(_opts(pki, verify="verify_peer", fail_if_no_peer_cert=True)))
    client = _MemClient(pki, cert=False)
    results = _handshake(server, client)
    # TLS 1.3: the client finishes its side first; its first read gets the server's alert
    if client.error is None:
        with pytest.raises(ssl.SSLError):
            client.obj.read(10)
    assert server.failed and "certificate" in server.failed.lower(), server.failed
    assert any(r.error for r in results)
    assert server.send(b"never") == b"" and server.receive(b"more").error  # a failed session stays failed


def test_format_name_is_rfc4514_most_specific_first():
    name = ((("countryName", "GB"),), (("organizationName", "A, B"),), (("commonName", "x"),))
    assert format_name(name) == "CN=x,O=A\\, B,C=GB"


# ---- the front end reports TLS connections ---------------------------------------------------------------
def test_frontend_connection_info_says_ssl():
    from test_amqp_frontend import (
        Host,  # the recording host of the front end's own tests
    )

    from mirrorq.amqp.frontend import FrontEnd

    host = Host()
    fe = FrontEnd(host, node="n1", dst="127.0.0.1:1", amqp_port=5672)
    plain = fe.open(0.0, "127.0.0.1", 40000)
    tls = fe.open(0.0, "127.0.0.1", 40001, port=5671, ssl=True)
    fe.tls_established(
        tls,
        {
            "ssl_protocol": "tlsv1.3",
            "ssl_cipher": "TLS_AES_256_GCM_SHA384",
            "peer_cert_subject": "CN=c",
            "peer_cert_issuer": "CN=ca",
            "peer_cert_validity": "a - b",
            "ignored": 1,
        },
    )
    rows = {r["peer_port"]: r for r in fe.connections(1.0)}
    assert (rows[40000]["ssl"], rows[40000]["port"], rows[40000]["ssl_protocol"]) == (False, 5672, None)
    assert rows[40000]["name"].endswith(":5672")
    t = rows[40001]
    assert (t["ssl"], t["port"], t["ssl_protocol"], t["peer_cert_subject"]) == (True, 5671, "tlsv1.3", "CN=c")
    assert t["name"] == "127.0.0.1:40001 -> 127.0.0.1:5671" and "ignored" not in t
    assert plain != tls
