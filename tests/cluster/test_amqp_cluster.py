"""Real clients (pika blocking + select, aio-pika, kombu) against a real 3-node cluster.

One cluster for the module (started once, always stopped).  Operations go
through different nodes than the queue's master on purpose: any node
accepts any client and routes to the master.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import conftest
import pytest
from conftest import LocalCluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pika = pytest.importorskip("pika")
aio_pika = pytest.importorskip("aio_pika")
kombu = pytest.importorskip("kombu")

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster():
    with conftest.running_cluster() as c:
        yield c


class _ShellCluster(LocalCluster):
    """A LocalCluster whose nodes use the given AMQP shell (node config ``amqp_shell``)."""

    def __init__(self, *args, shell: str, **kw):
        super().__init__(*args, **kw)
        self.shell = shell

    def ctl(self, *argv: str) -> int:
        if argv[:2] == ("cluster", "start"):
            argv = (*argv, "--amqp-shell", self.shell)
        return super().ctl(*argv)


@pytest.fixture(scope="module")
def aio_cluster():
    """The same cluster with the asyncio shell (mirrorq.amqp.aio_shell behind a bridge actor)."""
    with conftest.running_cluster(cls=_ShellCluster, shell="asyncio") as c:
        yield c


@pytest.fixture(params=["watch", "asyncio"], ids=lambda s: f"shell={s}")
def shell_cluster(request):
    """Both AMQP shells, for the key client tests (the others run on the watch shell)."""
    return request.getfixturevalue("cluster" if request.param == "watch" else "aio_cluster")


def params(c, node: int = 0, **kw):
    return pika.ConnectionParameters("127.0.0.1", c.amqp_base_port + node, connection_attempts=1, **kw)


def drain(conn, got: list, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        conn.process_data_events(0.05)


def test_pika_blocking_publish_confirm_consume_get_ack_nack_across_nodes(shell_cluster):
    cluster = shell_cluster
    a = pika.BlockingConnection(params(cluster, 0))
    b = pika.BlockingConnection(params(cluster, 1))
    try:
        ca, cb = a.channel(), b.channel()
        ca.queue_declare("orders", durable=True)
        cb.confirm_delivery()
        for i in range(100):
            cb.basic_publish("", "orders", b"o%d" % i, pika.BasicProperties(delivery_mode=2, headers={"i": i}))
        # declare-ok's count is the master's, read when it answers; every
        # publish above is confirmed, so it must be 100 (polled: in CI it
        # once read 98 -- if messages were really lost, the consume below fails)
        counts = [cb.queue_declare("orders", passive=True).method.message_count]
        deadline = time.monotonic() + 30
        while counts[-1] != 100 and time.monotonic() < deadline:
            time.sleep(0.1)  # polling interval of a condition with a deadline
            counts.append(cb.queue_declare("orders", passive=True).method.message_count)
        assert counts[-1] == 100, f"declare-ok message counts after 100 confirmed publishes: {counts}"
        m, props, body = ca.basic_get("orders")
        assert (body, m.redelivered, props.headers["i"]) == (b"o0", False, 0)
        ca.basic_nack(m.delivery_tag, requeue=True)
        m, _, body = ca.basic_get("orders")
        assert (body, m.redelivered) == (b"o0", True)
        ca.basic_reject(m.delivery_tag, requeue=False)  # o0 is gone
        got: list = []
        ca.basic_qos(prefetch_count=20)
        ca.basic_consume("orders", lambda ch, m, p, body: (got.append(body), ch.basic_ack(m.delivery_tag)))
        drain(a, got, 99)
        assert got == [b"o%d" % i for i in range(1, 100)]
        assert cb.queue_declare("orders", passive=True).method.message_count == 0
        # an unroutable mandatory publish comes back
        with pytest.raises(pika.exceptions.UnroutableError):
            cb.basic_publish("", "no-such-queue", b"x", mandatory=True)
    finally:
        a.close()
        b.close()


def test_pika_transactions_on_a_mirrored_queue(cluster):
    """tx.select / commit / rollback through pika, on another node than the
    queue's master: publishes and acks take effect at the commit only."""
    a = pika.BlockingConnection(params(cluster, 1))
    try:
        ch = a.channel()
        ch.queue_declare("tx-orders", durable=True)
        ch.tx_select()
        for i in range(10):
            ch.basic_publish("", "tx-orders", b"t%d" % i, pika.BasicProperties(delivery_mode=2))
        assert ch.queue_declare("tx-orders", passive=True).method.message_count == 0
        ch.tx_commit()
        assert ch.queue_declare("tx-orders", passive=True).method.message_count == 10
        ch.basic_publish("", "tx-orders", b"rolled back")
        ch.tx_rollback()
        got = []
        for _ in range(10):
            m, _, body = ch.basic_get("tx-orders")
            got.append(body)
            ch.basic_ack(m.delivery_tag)
        assert got == [b"t%d" % i for i in range(10)]
        ch.tx_rollback()  # the acks are dropped: the messages stay unacknowledged until the channel closes
        ch.close()
        ch = a.channel()
        assert ch.queue_declare("tx-orders", passive=True).method.message_count == 10
        ch.tx_select()
        for _ in range(10):
            m, _, _ = ch.basic_get("tx-orders")
            ch.basic_ack(m.delivery_tag)
        ch.tx_commit()
        assert ch.queue_declare("tx-orders", passive=True).method.message_count == 0
    finally:
        a.close()


def test_pika_exchanges_and_bindings(cluster):
    conn = pika.BlockingConnection(params(cluster, 2))
    try:
        ch = conn.channel()
        ch.exchange_declare("logs", "topic", durable=True)
        ch.exchange_declare("fan", "fanout")
        for q in ("errors", "all"):
            ch.queue_declare(q)
        ch.queue_bind("errors", "logs", "*.error")
        ch.queue_bind("all", "logs", "#")
        ch.exchange_bind("logs", "fan")  # fan -> logs (routing key "" matches '#')
        ch.confirm_delivery()
        ch.basic_publish("logs", "db.error", b"e1")
        ch.basic_publish("logs", "db.info", b"i1")
        ch.basic_publish("fan", "", b"f1")
        counts = {q: ch.queue_declare(q, passive=True).method.message_count for q in ("errors", "all")}
        assert counts == {"errors": 1, "all": 3}
        ch.queue_unbind("all", "logs", "#")
        ch.basic_publish("logs", "x.error", b"e2")
        assert ch.queue_declare("all", passive=True).method.message_count == 3
        assert ch.queue_declare("errors", passive=True).method.message_count == 2
        assert ch.queue_purge("errors").method.message_count == 2
        ch.exchange_delete("fan")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.exchange_declare("fan", passive=True)
        assert e.value.reply_code == 404 and "fan" in e.value.reply_text
    finally:
        conn.close()


@pytest.mark.parametrize("case", ["404", "406", "405", "403", "530-vhost", "auth"])
def test_error_codes_reach_pika(cluster, case):
    if case == "auth":
        with pytest.raises((pika.exceptions.ProbableAuthenticationError, pika.exceptions.AuthenticationError)):
            pika.BlockingConnection(params(cluster, 0, credentials=pika.PlainCredentials("guest", "wrong")))
        return
    if case == "530-vhost":
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as e:
            pika.BlockingConnection(params(cluster, 1, virtual_host="nowhere"))
        assert "(530)" in str(e.value) and "vhost 'nowhere' not found" in str(e.value)
        return
    conn = pika.BlockingConnection(params(cluster, 1))
    other = pika.BlockingConnection(params(cluster, 1))
    try:
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            if case == "404":
                ch.queue_declare("missing-q", passive=True)
            elif case == "406":
                ch.queue_declare("eq406", durable=True)
                ch.queue_declare("eq406", durable=False)
            elif case == "405":
                ch.queue_declare("excl405", exclusive=True)
                other.channel().basic_consume("excl405", lambda *a: None)
            elif case == "403":
                ch.queue_declare("amq.nope")
        assert e.value.reply_code == int(case)
        assert e.value.reply_text.split(" - ")[0] in (
            "NOT_FOUND",
            "PRECONDITION_FAILED",
            "RESOURCE_LOCKED",
            "ACCESS_REFUSED",
        )
        assert conn.is_open  # a channel error leaves the connection open
    finally:
        conn.close()
        other.close()


def test_pika_select_connection(shell_cluster):
    cluster = shell_cluster
    got: list = []
    state: dict = {}

    def on_open(conn):
        conn.channel(on_open_callback=on_channel)

    def on_channel(ch):
        state["ch"] = ch
        ch.queue_declare("sel", callback=lambda _: ch.confirm_delivery(on_confirm, callback=lambda _: start(ch)))

    def on_confirm(frame):
        state.setdefault("acks", 0)
        state["acks"] += 1

    def start(ch):
        for i in range(10):
            ch.basic_publish("", "sel", b"s%d" % i)
        ch.basic_consume("sel", on_msg)

    def on_msg(ch, m, p, body):
        got.append(body)
        ch.basic_ack(m.delivery_tag)
        if len(got) == 10:
            conn.close()

    conn = pika.SelectConnection(params(cluster, 2), on_open_callback=on_open)
    conn.ioloop.call_later(15, conn.ioloop.stop)
    conn.add_on_close_callback(lambda *a: conn.ioloop.stop())
    conn.ioloop.start()
    assert got == [b"s%d" % i for i in range(10)]
    assert state.get("acks", 0) >= 1


def test_aio_pika(shell_cluster):
    cluster = shell_cluster

    async def main():
        conn = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{cluster.amqp_base_port}/")
        async with conn:
            ch = await conn.channel(publisher_confirms=True, on_return_raises=True)
            ex = await ch.declare_exchange("aio-direct", aio_pika.ExchangeType.DIRECT)
            q = await ch.declare_queue("aio-q", durable=True)
            await q.bind(ex, "k")
            for i in range(20):
                await ex.publish(aio_pika.Message(b"a%d" % i), routing_key="k")
            with pytest.raises(aio_pika.exceptions.DeliveryError):
                await ex.publish(aio_pika.Message(b"lost"), routing_key="nobody", mandatory=True)
            bodies = []
            async with q.iterator() as it:
                async for msg in it:
                    async with msg.process():
                        bodies.append(msg.body)
                    if len(bodies) == 20:
                        break
            assert bodies == [b"a%d" % i for i in range(20)]
            tmp = await ch.declare_queue(exclusive=True)
            assert tmp.name.startswith("amq.gen-")

    asyncio.run(asyncio.wait_for(main(), 30))


def test_kombu(shell_cluster):
    cluster = shell_cluster
    from kombu import Connection, Exchange, Queue

    ex = Exchange("kombu-ex", type="direct")
    q = Queue("kombu-q", ex, routing_key="kq")
    with Connection(f"amqp://guest:guest@127.0.0.1:{cluster.amqp_base_port + 1}//") as conn:
        producer = conn.Producer()
        for i in range(10):
            producer.publish({"n": i}, exchange=ex, routing_key="kq", declare=[q], serializer="json")
        got = []
        with conn.Consumer(q, callbacks=[lambda body, msg: (got.append(body["n"]), msg.ack())]):
            deadline = time.monotonic() + 10
            while len(got) < 10 and time.monotonic() < deadline:
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass
        assert got == list(range(10))
        simple = conn.SimpleQueue("kombu-simple")
        simple.put({"hello": "world"})
        m = simple.get(timeout=5)
        assert m.payload == {"hello": "world"}
        m.ack()
        simple.close()


# ---- malformed frames against a live node ------------------------------------------------------
_HDR = b"AMQP\x00\x00\x09\x01"


def _raw_session(port: int, payload: bytes) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    try:
        s.sendall(payload)
        s.settimeout(0.3)
        try:
            while s.recv(65536):
                pass
        except (TimeoutError, ConnectionError):
            pass
    finally:
        s.close()


def _login() -> bytes:
    from pamqp import commands as C
    from pamqp import frame as F

    return (
        _HDR
        + F.marshal(C.Connection.StartOk(response="\0guest\0guest"), 0)
        + F.marshal(C.Connection.TuneOk(2047, 131072, 0), 0)
        + F.marshal(C.Connection.Open("/"), 0)
        + F.marshal(C.Channel.Open(), 1)
    )


def test_after_close_ok_the_client_closes_the_socket(shell_cluster):
    """As RabbitMQ: the node answers connection.close with close-ok and
    leaves the socket for the client to close (AMQP 0-9-1: the receiver of
    close-ok does), instead of closing it at once under the client."""
    from pamqp import commands as C
    from pamqp import frame as F

    s = socket.create_connection(("127.0.0.1", shell_cluster.amqp_base_port), timeout=10)
    try:
        s.sendall(_login() + F.marshal(C.Connection.Close(200, "bye", 0, 0), 0))
        got, buf = [], b""
        while not any(isinstance(f, C.Connection.CloseOk) for f in got):
            data = s.recv(65536)
            assert data, f"the node closed the socket before close-ok; frames so far: {got}"
            buf += data
            while True:
                try:
                    n, _, frame = F.unmarshal(buf)
                except Exception:  # noqa: BLE001 - an incomplete frame: read more
                    break
                got.append(frame)
                buf = buf[n:]
        s.settimeout(1.0)  # the window in which a node that closes first would have sent its FIN
        with pytest.raises(socket.timeout):
            s.recv(1)
    finally:
        s.close()


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    junk=st.one_of(
        st.binary(min_size=1, max_size=200),
        st.builds(
            lambda t, ch, size, body: struct.pack(">BHI", t, ch, size) + body,
            st.integers(0, 255),
            st.integers(0, 65535),
            st.integers(0, 1 << 31),
            st.binary(max_size=40),
        ),
    ),
    login=st.booleans(),
)
def test_fuzz_malformed_frames_then_a_good_client_works(cluster, junk, login):
    port = cluster.amqp_base_port + 2
    _raw_session(port, (_login() if login else b"") + junk)
    conn = pika.BlockingConnection(params(cluster, 2))
    try:
        ch = conn.channel()
        ch.queue_declare("after-fuzz")
        ch.confirm_delivery()
        ch.basic_publish("", "after-fuzz", b"ok")
        m, _, body = ch.basic_get("after-fuzz", auto_ack=True)
        assert body == b"ok"
    finally:
        conn.close()


def test_users_vhosts_permissions_through_mirrorctl(cluster):
    """rabbitmqctl's add_vhost / add_user / set_permissions / delete_user: a new
    user logs in to its vhost, its permissions are enforced (403), and once
    deleted it cannot log in.  Bad input is refused with a clear error."""
    c = cluster
    assert c.ctl("add_vhost", "shop") == 0
    assert c.ctl("add_user", "alice", "s3cret") == 0
    assert c.ctl("add_user", "alice", "again") == 70  # exists: refused, nothing changed
    # publishing through the default exchange needs write on amq.default (RabbitMQ's rule)
    assert (
        c.ctl("set_permissions", "-p", "shop", "alice", "^alice\\.", "^(alice\\..*|amq\\.default)$", "^alice\\.") == 0
    )
    assert c.ctl("set_permissions", "-p", "shop", "alice", "(", ".*", ".*") == 70  # bad regex
    assert c.ctl("set_permissions", "-p", "nowhere", "alice", ".*", ".*", ".*") == 70  # no such vhost
    creds = pika.PlainCredentials("alice", "s3cret")

    def connect():
        deadline = time.monotonic() + 10
        while True:  # every node's front end learns of the user from the registry
            try:
                return pika.BlockingConnection(params(c, 2, virtual_host="shop", credentials=creds))
            except pika.exceptions.AMQPConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # polling interval of a condition with a deadline

    conn = connect()
    try:
        ch = conn.channel()
        ch.queue_declare("alice.inbox", durable=True)
        ch.confirm_delivery()
        ch.basic_publish("", "alice.inbox", b"hello")
        method, _props, body = ch.basic_get("alice.inbox", auto_ack=True)
        assert body == b"hello"
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            conn.channel().queue_declare("bob.inbox")
        assert e.value.reply_code == 403
    finally:
        conn.close()
    assert c.ctl("delete_user", "alice") == 0
    assert c.ctl("delete_user", "alice") == 70  # gone: refused

    def login_refused():
        try:
            pika.BlockingConnection(params(c, 2, virtual_host="shop", credentials=creds)).close()
            return False
        except (
            pika.exceptions.ProbableAuthenticationError,
            pika.exceptions.AuthenticationError,
            pika.exceptions.ProbableAccessDeniedError,
        ):
            return True

    deadline = time.monotonic() + 10
    while not login_refused():
        assert time.monotonic() < deadline, "a deleted user can still log in"
        time.sleep(0.1)  # polling interval of a condition with a deadline


def test_pika_channel_prefetch_flow_consume_refusal_and_deleted_queues_bindings(cluster):
    """Issue #7's gaps through a real node: basic.qos global=true shared by a
    channel's consumers over two queues, channel.flow pause/resume, an
    exclusive-consumer conflict closing the channel with 403 (never a
    consume-ok), and the bindings of an auto-delete queue (deleted by its
    master when its consumer left) and of an exclusive queue (deleted when
    its connection closed) removed with the queue."""
    from mirrorq.admin.cluster import poll

    a = pika.BlockingConnection(params(cluster, 0))
    b = pika.BlockingConnection(params(cluster, 2))
    try:
        pub = b.channel()
        pub.confirm_delivery()
        for q in ("gq1", "gq2"):
            pub.queue_declare(q)
            for i in range(4):
                pub.basic_publish("", q, b"%s-%d" % (q.encode(), i))
        ch = a.channel()
        ch.basic_qos(prefetch_count=3, global_qos=True)
        got: list = []
        ch.basic_consume("gq1", lambda c, m, p, body: got.append(m.delivery_tag))
        ch.basic_consume("gq2", lambda c, m, p, body: got.append(m.delivery_tag))
        drain(a, got, 3)
        a.process_data_events(0.5)  # a window in which a 4th delivery would arrive if the limit leaked
        assert len(got) == 3, f"channel-wide prefetch 3, got {len(got)} unacked deliveries"
        ch.basic_ack(got[0])
        drain(a, got, 4)
        a.process_data_events(0.3)
        assert len(got) == 4
        # flow: paused, a publish is confirmed but not delivered; resumed, it comes
        ch.basic_ack(0, multiple=True)
        drain(a, got, 7)
        ch.basic_ack(0, multiple=True)
        drain(a, got, 8)
        assert len(got) == 8
        assert ch.flow(False) is False
        pub.basic_publish("", "gq1", b"while-paused")
        a.process_data_events(0.5)
        assert len(got) == 8, "a delivery arrived while channel.flow was inactive"
        assert ch.flow(True) is True
        drain(a, got, 9)
        assert len(got) == 9
        ch.basic_ack(0, multiple=True)
        # an exclusive consumer elsewhere: our consume is refused with 403, no consume-ok
        ex = b.channel()
        ex.queue_declare("gex")
        ex.basic_consume("gex", lambda *x: None, exclusive=True)
        other = a.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            other.basic_consume("gex", lambda *x: None)
        assert e.value.reply_code == 403 and "exclusive use" in e.value.reply_text

        # an auto-delete queue's bindings go with it
        c = a.channel()
        c.exchange_declare("adx", "direct")
        c.queue_declare("adq", auto_delete=True)
        c.queue_bind("adq", "adx", "k")
        tag = c.basic_consume("adq", lambda *x: None)
        c.basic_cancel(tag)  # the last consumer left: its master deletes the queue

        def gone(name: str) -> bool:
            probe = b.channel()
            try:
                probe.queue_declare(name, passive=True)
            except pika.exceptions.ChannelClosedByBroker as err:
                return err.reply_code == 404
            probe.close()
            return False

        assert poll(lambda: gone("adq"), 10), "auto-delete queue not deleted after its last consumer left"
        # an exclusive queue's bindings go when its connection closes
        excl = pika.BlockingConnection(params(cluster, 1))
        ec = excl.channel()
        ec.queue_declare("exq", exclusive=True)
        ec.queue_bind("exq", "adx", "e")
        excl.close()
        assert poll(lambda: gone("exq"), 10), "exclusive queue not deleted with its connection"
        # same names again, unbound: a mandatory publish to the exchange comes back
        p2 = b.channel()
        p2.queue_declare("adq")
        p2.queue_declare("exq")
        p2.confirm_delivery()

        def unroutable(key: str) -> bool:
            try:
                p2.basic_publish("adx", key, b"x", mandatory=True)
            except pika.exceptions.UnroutableError:
                return True
            p2.queue_purge("adq")
            p2.queue_purge("exq")
            return False

        assert poll(lambda: unroutable("k"), 30), "the deleted auto-delete queue's binding still routes"
        assert poll(lambda: unroutable("e"), 30), "the deleted exclusive queue's binding still routes"
        for q in ("adq", "exq", "gq1", "gq2", "gex"):
            p2.queue_delete(q)
    finally:
        a.close()
        b.close()
