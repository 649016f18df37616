"""The nemesis' clients: pika publishers (publisher confirms, one publish
outstanding at a time) and consumers (prefetch N, exactly one ``basic.ack``
per message), each a thread with its own connection, reconnecting to the
next node on any failure, recording every operation in a
:class:`~ctl.nemesis.history.HistoryWriter` (format in
:mod:`ctl.nemesis.history`).

Guarantees: every ``invoke`` gets exactly one completion record.  A publish
or declare that takes longer than ``op_timeout`` is cut by a watchdog that
shuts the connection's socket down (pika's blocking calls have no deadline
of their own); it is recorded ``info`` with ``"error": "timeout"`` (the
checker counts it as unanswered) and the client reconnects elsewhere.
Assumes the nodes' AMQP ports on 127.0.0.1.
"""

from __future__ import annotations

import socket
import threading
import time

import pika
import pika.exceptions

from ctl.nemesis.history import HistoryWriter


class _Watchdog:
    """Shuts a pika connection's socket down when an operation overruns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: pika.BlockingConnection | None = None
        self._deadline: float | None = None
        self.fired = False
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="nemesis-watchdog")
        self._t.start()

    def arm(self, conn: pika.BlockingConnection, timeout: float) -> None:
        with self._lock:
            self._conn, self._deadline, self.fired = conn, time.monotonic() + timeout, False

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                if self._deadline is not None and time.monotonic() > self._deadline:
                    self._deadline = None
                    self.fired = True
                    try:
                        conn = self._conn
                        assert conn is not None  # arm set it with the deadline
                        sock = conn._impl._transport._sock
                        sock.shutdown(socket.SHUT_RDWR)
                    except Exception:
                        pass

    def close(self) -> None:
        self._stop.set()


class Client(threading.Thread):
    def __init__(
        self,
        name: str,
        ports: dict[str, int],
        queue: str,
        history: HistoryWriter,
        op_timeout: float = 30.0,
        first: int = 0,
    ):
        super().__init__(name=name, daemon=True)
        self.cid, self.ports, self.queue, self.h = name, ports, queue, history
        self.nodes = sorted(ports)
        self.op_timeout = op_timeout
        self.turn = first
        self.node: str | None = None  # the node it is connected to (None between connections)
        self.stop_event = threading.Event()
        self.wd = _Watchdog()
        self.conn = None
        self.errors: list[str] = []

    def _connect(self):
        node = self.nodes[self.turn % len(self.nodes)]
        self.turn += 1
        params = pika.ConnectionParameters(
            "127.0.0.1",
            self.ports[node],
            connection_attempts=1,
            socket_timeout=3,
            stack_timeout=6,
            blocked_connection_timeout=10,
            heartbeat=10,
        )
        try:
            conn = pika.BlockingConnection(params)
        except Exception as e:  # noqa: BLE001 -- any failure: next node
            self.h.record("fail", "connect", node, process=self.cid, error=type(e).__name__)
            return None, node
        self.h.record("ok", "connect", node, process=self.cid)
        return conn, node

    def _declare(self, ch, node: str) -> None:
        self.h.record("invoke", "declare", self.queue, process=self.cid, node=node)
        self.wd.arm(self.conn, self.op_timeout)
        try:
            ch.queue_declare(self.queue, durable=True)
        except BaseException as e:
            err = "timeout" if self.wd.fired else type(e).__name__
            self.wd.disarm()
            typ = "fail" if isinstance(e, pika.exceptions.ChannelClosedByBroker) else "info"
            self.h.record(typ, "declare", self.queue, process=self.cid, node=node, error=err)
            raise
        self.wd.disarm()
        self.h.record("ok", "declare", self.queue, process=self.cid, node=node)

    def stop(self) -> None:
        self.stop_event.set()

    def _close(self) -> None:
        conn, self.conn, self.node = self.conn, None, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                conn, node = self._connect()
                if conn is None:
                    self.stop_event.wait(0.3)
                    continue
                self.conn, self.node = conn, node
                try:
                    self.session(conn, node)
                except Exception as e:  # noqa: BLE001 -- the connection is gone: reconnect
                    self.errors.append(f"{node}: {type(e).__name__}: {e}")
                finally:
                    self._close()
        finally:
            self.wd.close()

    def session(self, conn, node: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class Publisher(Client):
    """Publishes ``"<id>-<seq>"`` persistent messages, one at a time, each
    waiting for its confirm; ``rate`` caps messages per second (0: no cap)."""

    def __init__(self, *a, rate: float = 0.0, **kw):
        super().__init__(*a, **kw)
        self.seq = 0
        self.rate = rate
        self.publishing = threading.Event()
        self.publishing.set()

    def session(self, conn, node: str) -> None:
        ch = conn.channel()
        ch.confirm_delivery()
        self._declare(ch, node)
        while not self.stop_event.is_set():
            if not self.publishing.is_set():
                conn.process_data_events(0.1)
                continue
            self.seq += 1
            mid = f"{self.cid}-{self.seq}"
            props = pika.BasicProperties(delivery_mode=2, message_id=mid)
            self.h.record("invoke", "publish", mid, process=self.cid, publisher=self.cid, seq=self.seq, node=node)
            t0 = time.monotonic()
            self.wd.arm(conn, self.op_timeout)
            try:
                ch.basic_publish("", self.queue, mid.encode(), props, mandatory=False)
            except pika.exceptions.NackError:
                self.wd.disarm()
                self.h.record(
                    "fail", "publish", mid, process=self.cid, publisher=self.cid, seq=self.seq, node=node, error="nack"
                )
                continue
            except BaseException as e:
                err = "timeout" if self.wd.fired else type(e).__name__
                self.wd.disarm()
                self.h.record(
                    "info", "publish", mid, process=self.cid, publisher=self.cid, seq=self.seq, node=node, error=err
                )
                raise
            self.wd.disarm()
            self.h.record(
                "ok",
                "publish",
                mid,
                process=self.cid,
                publisher=self.cid,
                seq=self.seq,
                node=node,
                latency=round(time.monotonic() - t0, 4),
            )
            if self.rate:
                spare = 1.0 / self.rate - (time.monotonic() - t0)
                if spare > 0:
                    conn.sleep(spare)


class Consumer(Client):
    """basic.consume with ``prefetch``; each delivery is recorded ``ok`` and
    then acked alone (``basic.ack`` of that delivery tag, multiple=False)."""

    def __init__(self, *a, prefetch: int = 50, **kw):
        super().__init__(*a, **kw)
        self.prefetch = prefetch
        self.last_delivery = time.monotonic()
        self.delivered = 0

    def session(self, conn, node: str) -> None:
        ch = conn.channel()
        self._declare(ch, node)
        ch.basic_qos(prefetch_count=self.prefetch)

        def on_message(chan, method, props, body):
            mid = props.message_id or body.decode(errors="replace")
            self.h.record("ok", "consume", mid, process=self.cid, node=node, redelivered=bool(method.redelivered))
            self.delivered += 1
            self.last_delivery = time.monotonic()
            chan.basic_ack(method.delivery_tag)

        ch.basic_consume(self.queue, on_message)
        while not self.stop_event.is_set():
            conn.process_data_events(0.2)
