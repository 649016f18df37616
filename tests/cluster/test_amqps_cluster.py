"""AMQPS on a real cluster: TLS clients (pika, aio-pika, kombu) on every
node's ``amqps_port`` beside plain clients on the AMQP port.

The nodes run with ``verify: verify_peer`` and ``fail_if_no_peer_cert:
true`` (certificates from a test CA made here with trustme), so a client
with a certificate from the CA gets in and one without is refused.  The
watch shell (the default) serves a 3-node cluster; a 1-node cluster checks
the asyncio shell.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl

import conftest
import pytest
import yaml
from conftest import LocalCluster, wait_for

from mirrorq.amqp.listener import LINGER

pika = pytest.importorskip("pika")
trustme = pytest.importorskip("trustme")

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("amqps-pki")
    ca = trustme.CA(organization_name="mirrorq test CA")
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("tls-client.example.org", common_name="tls-client")
    paths = {k: str(d / k) for k in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}
    ca.cert_pem.write_to_path(paths["ca.pem"])
    server.cert_chain_pems[0].write_to_path(paths["server.pem"])
    server.private_key_pem.write_to_path(paths["server.key"])
    client.cert_chain_pems[0].write_to_path(paths["client.pem"])
    client.private_key_pem.write_to_path(paths["client.key"])
    return paths


class TLSCluster(LocalCluster):
    """A LocalCluster whose node.yaml files add ``amqps_port`` (a block of
    free ports) and ``ssl_options`` before the nodes start."""

    def __init__(self, *args, pki: dict, shell: str = "watch", **kw):
        super().__init__(*args, **kw)
        self.pki, self.shell = pki, shell
        self.amqps_base_port = conftest.free_port_block(self.nodes)

    def start(self) -> None:
        names = self.cluster.create(
            self.nodes,
            self.base_port,
            self.amqp_base_port,
            self.interval,
            self.timeout,
            self.snapshot_every,
            amqp_shell=self.shell,
            management_base_port=self.management_base_port,
        )
        for i, name in enumerate(names):
            path = self.cluster.config_path(name)
            raw = yaml.safe_load(path.read_text())
            raw["amqps_port"] = self.amqps_base_port + i
            raw["ssl_options"] = {
                "cacertfile": self.pki["ca.pem"],
                "certfile": self.pki["server.pem"],
                "keyfile": self.pki["server.key"],
                "verify": "verify_peer",
                "fail_if_no_peer_cert": True,
            }
            path.write_text(yaml.safe_dump(raw, sort_keys=False))
        super().start()  # `cluster start` finds the layout written above

    def client_context(self, cert: bool = True) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.pki["ca.pem"])
        if cert:
            ctx.load_cert_chain(self.pki["client.pem"], self.pki["client.key"])
        return ctx

    def tls_params(self, node: int = 0, cert: bool = True):
        return pika.ConnectionParameters(
            "127.0.0.1",
            self.amqps_base_port + node,
            connection_attempts=1,
            blocked_connection_timeout=60,
            ssl_options=pika.SSLOptions(self.client_context(cert), server_hostname="127.0.0.1"),
        )


@pytest.fixture(scope="module")
def tls_cluster(pki):
    with conftest.running_cluster(cls=TLSCluster, pki=pki) as c:
        yield c


def _consume(conn, ch, queue: str, n: int, timeout: float = 30.0) -> list[bytes]:
    """Consume ``n`` messages from ``queue`` with one ack per message."""
    got: list[bytes] = []

    def on_message(ch, m, props, body):
        got.append(body)
        ch.basic_ack(m.delivery_tag)

    ch.basic_qos(prefetch_count=50)
    tag = ch.basic_consume(queue, on_message)
    wait_for(lambda: (conn.process_data_events(0.05) or len(got) >= n, len(got)), timeout, f"{n} messages")
    ch.basic_cancel(tag)
    return got


def test_pika_over_tls_on_a_mirrored_queue_beside_a_plain_client(tls_cluster):
    """Publish with confirms over TLS on node2, consume with per-message acks
    over TLS on node3, of a queue mirrored on all three nodes, while a plain
    client on node1's AMQP port does the same on another queue (interleaved,
    all connections open together); the connections are listed with ssl
    true/false, their ports and the TLS client's certificate."""
    c = tls_cluster
    assert c.ctl("set_policy", "--apply-to", "queues", "tls-ha", r"^tls\.", '{"ha-mode":"all"}') == 0
    n = 300
    plain = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port, connection_attempts=1))
    pub = pika.BlockingConnection(c.tls_params(1))
    sub = pika.BlockingConnection(c.tls_params(2))
    try:
        plch, pch, sch = plain.channel(), pub.channel(), sub.channel()
        for ch in (plch, pch):
            ch.confirm_delivery()
        plch.queue_declare("tls.plain", durable=True)
        pch.queue_declare("tls.orders", durable=True)
        c.wait_mirrored("tls.orders")
        for i in range(n):  # each basic_publish returns once the publish is confirmed
            pch.basic_publish("", "tls.orders", b"t%d" % i, pika.BasicProperties(delivery_mode=2, headers={"i": i}))
            plch.basic_publish("", "tls.plain", b"p%d" % i, pika.BasicProperties(delivery_mode=2))
        conns = c.json("list_connections", "name", "ssl", "port", "peer_cert_subject", "ssl_protocol", "user")
        tls_rows = [r for r in conns if r["ssl"]]
        assert sorted(r["port"] for r in tls_rows) == [c.amqps_base_port + 1, c.amqps_base_port + 2], conns
        assert all(
            r["peer_cert_subject"].startswith("CN=tls-client")
            and r["ssl_protocol"].startswith("tlsv1.")
            and r["user"] == "guest"
            for r in tls_rows
        ), tls_rows
        plain_rows = [r for r in conns if not r["ssl"]]
        assert [(r["port"], r["peer_cert_subject"]) for r in plain_rows] == [(c.amqp_base_port, None)], conns
        got = _consume(sub, sch, "tls.orders", n)
        assert got == [b"t%d" % i for i in range(n)]
        assert _consume(plain, plch, "tls.plain", n) == [b"p%d" % i for i in range(n)]
        assert sch.queue_declare("tls.orders", passive=True).method.message_count == 0
        assert len(c.queue_row("tls.orders")["synchronised_slave_pids"]) == 2
    finally:
        for conn in (plain, pub, sub):
            if conn.is_open:
                conn.close()


def test_management_api_reports_ssl(tls_cluster):
    import base64
    import urllib.request

    c = tls_cluster
    conn = pika.BlockingConnection(c.tls_params(0))
    try:

        def api_conns():
            req = urllib.request.Request(f"http://127.0.0.1:{c.management_base_port}/api/connections")
            req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    rows = json.loads(r.read())
            except OSError as e:  # the management server starts after the node
                return False, repr(e)
            return any(x["ssl"] for x in rows), rows

        rows = wait_for(api_conns, 30, "a TLS connection in /api/connections")
        mine = [x for x in rows if x["ssl"]]
        assert mine[0]["port"] == c.amqps_base_port and mine[0]["peer_cert_subject"].startswith("CN=tls-client")
        req = urllib.request.Request(f"http://127.0.0.1:{c.management_base_port}/api/overview")
        req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
        with urllib.request.urlopen(req, timeout=30) as r:
            listeners = json.loads(r.read())["listeners"]
        assert any(li["protocol"] == "amqp/ssl" and li["port"] == c.amqps_base_port for li in listeners), listeners
    finally:
        conn.close()


def test_a_client_without_a_certificate_is_refused(tls_cluster):
    """verify_peer + fail_if_no_peer_cert: the TLS handshake fails, the node
    logs why, and keeps serving clients that have one."""
    c = tls_cluster
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(c.tls_params(0, cert=False))
    log = c.data_dir / "node1" / "node.log"
    wait_for(lambda: ("amqps_handshake_failed" in log.read_text(), None), 10, "the refusal in node1's log")
    line = next(json.loads(x) for x in log.read_text().splitlines() if "amqps_handshake_failed" in x)
    assert "certificate" in json.dumps(line).lower(), line
    # a client that does not trust our CA refuses the node (its own verification fails)
    with pytest.raises(ssl.SSLCertVerificationError):
        pika.BlockingConnection(
            pika.ConnectionParameters(
                "127.0.0.1",
                c.amqps_base_port,
                connection_attempts=1,
                ssl_options=pika.SSLOptions(ssl.create_default_context(), server_hostname="127.0.0.1"),
            )
        )
    wait_for(
        lambda: (log.read_text().count("amqps_handshake_failed") == 2, None),
        10,
        "the client's refusal in node1's log too",
    )
    conn = pika.BlockingConnection(c.tls_params(0))
    try:
        assert conn.channel().queue_declare("", exclusive=True).method.queue
    finally:
        conn.close()


async def _aio_round_trip(c, port: int) -> bytes:
    """aio-pika over amqps://: declare, publish, get, ack, close (in time)."""
    import aio_pika

    conn = await aio_pika.connect(f"amqps://guest:guest@127.0.0.1:{port}/", ssl_context=c.client_context())
    try:
        ch = await conn.channel()
        q = await ch.declare_queue("tls.aio", durable=True)
        await ch.default_exchange.publish(aio_pika.Message(b"aio"), routing_key="tls.aio")
        msg = await q.get(timeout=10)
        await msg.ack()
    finally:
        # asyncio's TLS close waits for the node's close_notify: the node
        # answers it, not its linger timeout (LINGER, 5 s) after close-ok
        await asyncio.wait_for(conn.close(), LINGER / 2)
    return msg.body


def test_aio_pika_amqps_url_and_kombu_ssl(tls_cluster):
    pytest.importorskip("aio_pika")
    kombu = pytest.importorskip("kombu")
    c = tls_cluster

    assert asyncio.run(asyncio.wait_for(_aio_round_trip(c, c.amqps_base_port + 1), 60)) == b"aio"

    ssl_opts = {
        "ca_certs": c.pki["ca.pem"],
        "certfile": c.pki["client.pem"],
        "keyfile": c.pki["client.key"],
        "cert_reqs": ssl.CERT_REQUIRED,
        "server_hostname": "127.0.0.1",
    }
    with kombu.Connection(
        f"amqp://guest:guest@127.0.0.1:{c.amqps_base_port + 2}//", ssl=ssl_opts, connect_timeout=10
    ) as kc:
        q = kombu.Queue("tls.kombu", routing_key="tls.kombu", durable=True)
        with kc.Producer() as prod:
            prod.publish({"k": 1}, routing_key="tls.kombu", declare=[q], serializer="json")
        got = []

        def pump():
            if not got:
                with contextlib.suppress(socket.timeout):
                    kc.drain_events(timeout=1)
            return bool(got), got

        with kc.Consumer(q, callbacks=[lambda body, m: (got.append(body), m.ack())], accept=["json"]):
            wait_for(pump, 30, "kombu's message")
        assert got == [{"k": 1}]


class _AioTLSCluster(TLSCluster):
    def __init__(self, *args, **kw):
        super().__init__(*args, shell="asyncio", **kw)


def test_asyncio_shell_serves_tls(pki):
    pytest.importorskip("aio_pika")
    with conftest.running_cluster(nodes=1, cls=_AioTLSCluster, pki=pki) as c:
        conn = pika.BlockingConnection(c.tls_params(0))
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare("tls.aio-shell")
            for i in range(50):
                ch.basic_publish("", "tls.aio-shell", b"a%d" % i)
            assert _consume(conn, ch, "tls.aio-shell", 50) == [b"a%d" % i for i in range(50)]
            rows = c.json("list_connections", "ssl", "port", "peer_cert_subject")
            assert rows == [{"ssl": True, "port": c.amqps_base_port, "peer_cert_subject": rows[0]["peer_cert_subject"]}]
            assert rows[0]["peer_cert_subject"].startswith("CN=tls-client")
        finally:
            conn.close()
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            pika.BlockingConnection(c.tls_params(0, cert=False))
        assert asyncio.run(asyncio.wait_for(_aio_round_trip(c, c.amqps_base_port), 60)) == b"aio"
