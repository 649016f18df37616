"""pika clients shaped like applications, for the benchmarks and the data-path tests.

Each client runs in its own process (:func:`spawn`), so the measuring
process never competes with it for the GIL, and reports one dict:

* :func:`publisher`: publisher confirms with ``window`` publishes in flight
  (``window=1`` is the one-at-a-time publisher whose confirm latency we
  report as p50/p99), persistent 1 KiB messages whose body starts with a
  unique id ``<tag>:<n>``;
* :func:`consumer`: ``basic.qos(prefetch)`` and ONE ``basic.ack`` per
  message (``multiple=false``), what almost every application does; it
  records every id it got, so a caller can check "each message exactly once";
* :func:`deliver_latency`: a consumer already consuming, then a publisher
  whose every body carries ``time.monotonic_ns()`` of its publish (Linux's
  monotonic clock is one clock for every process of the machine), so the
  consumer measures publish -> delivery per message.

Both use pika's ``SelectConnection`` (the cheapest pika client, so the client
is not the bottleneck; the CPU seconds each process used are reported as
``cpu`` so a reader can check that).  Both give up when nothing progresses
for ``stall`` seconds and say what was missing (``stalled``): a benchmark
never waits forever, and a test can assert on it.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_mod
import statistics
import time
from collections.abc import Callable
from typing import Any

BODY_SIZE = 1024


def body_for(tag: str, n: int, size: int = BODY_SIZE, stamp: int | None = None) -> bytes:
    """``<tag>:<n>:`` (and ``<stamp>:``, a ``time.monotonic_ns()``, when given), padded to ``size``."""
    head = (f"{tag}:{n}:" if stamp is None else f"{tag}:{n}:{stamp}:").encode()
    return head + b"x" * max(0, size - len(head))


def stamp_of(body: bytes) -> int:
    """The ``time.monotonic_ns()`` a :func:`body_for` body was stamped with."""
    return int(body.split(b":", 3)[2])


def id_of(body: bytes) -> str:
    tag, n, _ = body.split(b":", 2)
    return f"{tag.decode()}:{int(n)}"


def _percentile(xs: list, p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100.0 * (len(xs) - 1)))))
    return xs[k]


class _Publisher:
    """One publishing connection (pika ``SelectConnection``) on ``ioloop``:
    ``n`` messages to ``queue`` with confirms, at most ``window`` unconfirmed;
    ``done()`` is called once it finished, stalled or failed."""

    def __init__(
        self,
        port: int,
        queue: str,
        n: int,
        window: int,
        tag: str,
        stall: float,
        host: str,
        ioloop: Any = None,
        done: Callable[[], None] | None = None,
        stamp: bool = False,
    ) -> None:
        import pika

        self.queue, self.n, self.window, self.tag, self.stall = queue, n, window, tag, stall
        self.stamp = stamp
        self.sent = self.acked = self.nacked = 0
        self.t0 = self.t1 = self.last_progress = 0.0
        self.stalled: str | None = None
        self.error: str | None = None
        self.sent_at: dict[int, float] = {}
        self.lat: list[float] = []
        self.props = pika.BasicProperties(delivery_mode=2)
        self.ch: Any = None
        self._done = done or (lambda: None)
        self.finished = False
        params = pika.ConnectionParameters(host, port, heartbeat=0, connection_attempts=3, retry_delay=0.5)
        self.conn = pika.SelectConnection(
            params,
            on_open_callback=lambda c: c.channel(on_open_callback=self._on_channel),
            on_open_error_callback=lambda c, e: self._finish(f"open: {e}"),
            on_close_callback=self._on_close,
            custom_ioloop=ioloop,
        )
        self.conn.ioloop.call_later(0.5, self._watchdog)

    def _pump(self) -> None:
        while self.sent < self.n and self.sent - self.acked - self.nacked < self.window:
            self.sent += 1
            self.sent_at[self.sent] = time.monotonic()
            body = body_for(self.tag, self.sent, stamp=time.monotonic_ns() if self.stamp else None)
            self.ch.basic_publish("", self.queue, body, self.props)

    def _on_confirm(self, frame: Any) -> None:
        m = frame.method
        now = time.monotonic()
        tags = (
            [t for t in self.sent_at if t <= m.delivery_tag]
            if m.multiple
            else ([m.delivery_tag] if m.delivery_tag in self.sent_at else [])
        )
        for t in tags:
            self.lat.append(now - self.sent_at.pop(t))
        if m.NAME == "Basic.Nack":
            self.nacked += len(tags)
        else:
            self.acked += len(tags)
        if tags:
            self.last_progress = now
        if self.acked + self.nacked >= self.n:
            self.t1 = time.monotonic()
            self.conn.close()
        else:
            self._pump()

    def _on_channel(self, ch: Any) -> None:
        self.ch = ch

        def begin(_f: Any) -> None:
            self.t0 = self.last_progress = time.monotonic()
            self._pump()

        ch.confirm_delivery(self._on_confirm, callback=begin)

    def _watchdog(self) -> None:
        if self.t1 or self.finished or not self.conn.is_open:
            return
        if self.t0 and time.monotonic() - self.last_progress > self.stall:
            self.stalled = (
                f"no confirm for {self.stall:.0f}s: {self.sent} published, {self.acked} acked, "
                f"{self.nacked} nacked, {self.sent - self.acked - self.nacked} waiting"
            )
            self.conn.close()
            return
        self.conn.ioloop.call_later(0.5, self._watchdog)

    def _on_close(self, _c: Any, reason: Any) -> None:
        self._finish(None if self.t1 or self.stalled else f"connection closed: {reason}")

    def _finish(self, error: str | None) -> None:
        if not self.finished:
            self.finished = True
            self.error = self.error or error
            self._done()

    def report(self, cpu0: float) -> dict:
        t1 = self.t1 or time.monotonic()
        return {
            "published": self.sent,
            "confirmed": self.acked,
            "nacked": self.nacked,
            "rate": self.acked / (t1 - self.t0) if self.t0 and t1 > self.t0 else 0.0,
            "latency_p50": _percentile(self.lat, 50),
            "latency_p99": _percentile(self.lat, 99),
            "latency_mean": statistics.fmean(self.lat) if self.lat else float("nan"),
            "cpu": time.process_time() - cpu0,
            "stalled": self.stalled,
            "error": self.error,
            "t0": self.t0,
            "t1": t1,
        }


def publisher(
    port: int,
    queue: str,
    n: int,
    window: int,
    *,
    tag: str = "p0",
    stall: float = 30.0,
    start_at: float = 0.0,
    host: str = "127.0.0.1",
    stamp: bool = False,
) -> dict:
    """Publish ``n`` messages to ``queue`` through the default exchange with
    confirms, at most ``window`` unconfirmed (``stamp``: each body carries
    the ``time.monotonic_ns()`` of its publish, :func:`stamp_of`).  Returns
    ``published``, ``confirmed``, ``nacked``, ``rate`` (confirmed msg/s
    from the first publish to the last confirm), ``latency_p50``/``latency_p99``
    (seconds, publish to confirm), ``cpu`` and ``stalled`` (None, or what was missing)."""
    cpu0 = time.process_time()
    _wait_until(start_at)
    box: list = []
    p = _Publisher(port, queue, n, window, tag, stall, host, done=lambda: box[0].conn.ioloop.stop(), stamp=stamp)
    box.append(p)
    p.conn.ioloop.start()
    return p.report(cpu0)


def many_publishers(
    port: int,
    queue: str,
    connections: int,
    per_connection: int,
    window: int,
    *,
    tag: str = "c",
    stall: float = 30.0,
    host: str = "127.0.0.1",
) -> dict:
    """``connections`` publishing connections at once in this one process (one
    pika IOLoop): what several hundred application connections look like to
    a node.  Connection ``i`` publishes ``per_connection`` messages tagged
    ``<tag><i>`` with confirms (``window`` in flight).  Returns the totals
    (``published``, ``confirmed``, ``nacked``), ``stalled``/``errors`` (the
    connections that did not finish cleanly), ``cpu`` and wall ``t0``/``t1``."""
    from pika.adapters.select_connection import IOLoop

    cpu0 = time.process_time()
    loop = IOLoop()
    left = [connections]

    def one_done() -> None:
        left[0] -= 1
        if left[0] == 0:
            loop.stop()

    pubs = [
        _Publisher(port, queue, per_connection, window, f"{tag}{i}", stall, host, ioloop=loop, done=one_done)
        for i in range(connections)
    ]
    t0 = time.monotonic()
    loop.start()
    return {
        "published": sum(p.sent for p in pubs),
        "confirmed": sum(p.acked for p in pubs),
        "nacked": sum(p.nacked for p in pubs),
        "stalled": [p.stalled for p in pubs if p.stalled],
        "errors": [p.error for p in pubs if p.error],
        "cpu": time.process_time() - cpu0,
        "t0": t0,
        "t1": time.monotonic(),
    }


def consumer(
    port: int,
    queue: str,
    n: int,
    prefetch: int,
    *,
    stall: float = 30.0,
    start_at: float = 0.0,
    host: str = "127.0.0.1",
    keep_ids: bool = True,
    ready: Any = None,
    stamps: bool = False,
) -> dict:
    """Consume ``n`` messages from ``queue`` with ``basic.qos(prefetch)`` and
    one ``basic.ack`` per message.  Returns ``consumed``, ``rate`` (msg/s
    from the consume-ok to the n-th message), ``ids`` (every message id in
    arrival order, if ``keep_ids``), ``redelivered``, ``cpu`` and ``stalled``.
    ``ready``: a multiprocessing ``Event`` set at the consume-ok.
    ``stamps``: the bodies are stamped (:func:`stamp_of`); also returns
    ``delivery_p50``/``delivery_p99`` (seconds from publish to delivery)."""
    import pika

    st: dict[str, Any] = {"got": 0, "t0": 0.0, "t1": 0.0, "last": 0.0, "stalled": None, "error": None, "redelivered": 0}
    ids: list[str] = []
    lat: list[float] = []
    cpu0 = time.process_time()
    conn_box: dict[str, Any] = {}

    def on_message(ch, method, _props, body) -> None:
        if stamps:
            lat.append((time.monotonic_ns() - stamp_of(body)) / 1e9)
        st["got"] += 1
        st["last"] = time.monotonic()
        if method.redelivered:
            st["redelivered"] += 1
        if keep_ids:
            ids.append(id_of(body))
        ch.basic_ack(method.delivery_tag)
        if st["got"] >= n and not st["t1"]:
            st["t1"] = time.monotonic()
            conn_box["c"].close()

    def on_qos(ch) -> None:
        ch.basic_consume(
            queue,
            lambda c, m, p, b: on_message(c, m, p, b),
            callback=lambda _f: consuming(),
        )

    def consuming() -> None:
        st["t0"] = st["last"] = time.monotonic()
        if ready is not None:
            ready.set()

    def on_channel(ch) -> None:
        ch.basic_qos(prefetch_count=prefetch, callback=lambda _f: on_qos(ch))

    def watchdog() -> None:
        c = conn_box["c"]
        if st["t1"] or not c.is_open:
            return
        if st["t0"] and time.monotonic() - st["last"] > stall:
            st["stalled"] = f"no delivery for {stall:.0f}s: {st['got']} of {n} consumed"
            c.close()
            return
        c.ioloop.call_later(0.5, watchdog)

    def on_close(_c, reason) -> None:
        if not st["t1"] and st["stalled"] is None:
            st["error"] = f"connection closed: {reason}"
        _c.ioloop.stop()

    _wait_until(start_at)
    params = pika.ConnectionParameters(host, port, heartbeat=0, connection_attempts=3, retry_delay=0.5)
    conn = pika.SelectConnection(
        params,
        on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
        on_open_error_callback=lambda c, e: (st.__setitem__("error", f"open: {e}"), c.ioloop.stop()),
        on_close_callback=on_close,
    )
    conn_box["c"] = conn
    conn.ioloop.call_later(0.5, watchdog)
    conn.ioloop.start()
    t1 = st["t1"] or st["last"] or time.monotonic()
    return {
        "consumed": st["got"],
        "rate": st["got"] / (t1 - st["t0"]) if st["t0"] and t1 > st["t0"] else 0.0,
        "ids": ids,
        "redelivered": st["redelivered"],
        "delivery_p50": _percentile(lat, 50),
        "delivery_p99": _percentile(lat, 99),
        "cpu": time.process_time() - cpu0,
        "stalled": st["stalled"],
        "error": st["error"],
        "t0": st["t0"],
        "t1": t1,
    }


def _wait_until(t: float) -> None:
    """Start together with the other clients of a run (a wall-clock instant)."""
    while t and time.time() < t:
        time.sleep(min(0.01, max(0.0, t - time.time())))


def _child(fn: Callable, args: tuple, kw: dict, out: Any) -> None:
    try:
        out.put(("ok", fn(*args, **kw)))
    except BaseException as e:  # report, never hang the parent
        out.put(("error", f"{type(e).__name__}: {e}"))


class Spawned:
    """A client running in its own process; :meth:`result` waits for its dict."""

    def __init__(self, fn: Callable, *args: Any, **kw: Any) -> None:
        ctx = multiprocessing.get_context("fork")
        self.q = ctx.Queue()
        self.proc = ctx.Process(target=_child, args=(fn, args, kw, self.q), daemon=True)
        self.proc.start()

    def result(self, timeout: float) -> dict:
        try:
            status, value = self.q.get(timeout=timeout)
        except queue_mod.Empty:
            value, status = None, "timeout"
        finally:
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        if status != "ok":
            raise RuntimeError(f"client process failed: {status} {value or ''}")
        return value


def spawn(fn: Callable, *args: Any, **kw: Any) -> Spawned:
    return Spawned(fn, *args, **kw)


def concurrent(
    port: int,
    queues: list,
    per_queue: int,
    window: int,
    prefetch: int,
    *,
    stall: float = 30.0,
    ports: list | None = None,
    timeout: float = 600.0,
    keep_ids: bool = False,
) -> dict:
    """One publisher and one consumer per queue, all started at the same
    instant, each in its own process (``ports[i]``: where queue i's clients
    connect; default ``port``).  Returns the clients' dicts and the totals:
    ``publish_rate`` / ``consume_rate`` (messages over the span from the
    common start to the last confirm / delivery), ``client_cpu`` (CPU
    seconds of all client processes over that span's wall time)."""
    start = time.time() + 0.5
    ports = ports or [port] * len(queues)
    pubs = [
        spawn(publisher, ports[i], q, per_queue, window, tag=f"p{i}", stall=stall, start_at=start)
        for i, q in enumerate(queues)
    ]
    cons = [
        spawn(consumer, ports[i], q, per_queue, prefetch, stall=stall, start_at=start, keep_ids=keep_ids)
        for i, q in enumerate(queues)
    ]
    p = [s.result(timeout) for s in pubs]
    c = [s.result(timeout) for s in cons]
    t0 = min(x["t0"] for x in p + c if x["t0"]) if any(x["t0"] for x in p + c) else 0.0
    pub_end = max((x["t1"] for x in p), default=0.0)
    con_end = max((x["t1"] for x in c), default=0.0)
    total = per_queue * len(queues)
    wall = max(pub_end, con_end) - t0 if t0 else 0.0
    return {
        "publishers": p,
        "consumers": c,
        "publish_rate": sum(x["confirmed"] for x in p) / (pub_end - t0) if t0 and pub_end > t0 else 0.0,
        "consume_rate": sum(x["consumed"] for x in c) / (con_end - t0) if t0 and con_end > t0 else 0.0,
        "complete": all(x["confirmed"] == per_queue for x in p) and all(x["consumed"] >= per_queue for x in c),
        "stalled": [x["stalled"] or x["error"] for x in p + c if x["stalled"] or x["error"]],
        "client_cpu": sum(x["cpu"] for x in p + c) / wall if wall > 0 else 0.0,
        "total": total,
    }


def drain(port: int, queue: str, n: int, prefetch: int, *, stall: float = 30.0, timeout: float = 600.0) -> dict:
    """Consume a backlog of ``n`` with one ack per message (its own process)."""
    return spawn(consumer, port, queue, n, prefetch, stall=stall, keep_ids=False).result(timeout)


def fill(port: int, queue: str, n: int, window: int = 1000, *, stall: float = 30.0, timeout: float = 600.0) -> dict:
    return spawn(publisher, port, queue, n, window, stall=stall).result(timeout)


def deliver_latency(
    port: int, queue: str, n: int, prefetch: int, *, stall: float = 30.0, timeout: float = 600.0
) -> dict:
    """Publish -> delivery to a waiting consumer: a consumer (``prefetch``)
    starts consuming ``queue``; once it has its consume-ok, a publisher
    publishes ``n`` stamped messages one at a time (window 1, each after
    the previous one's confirm).  Returns the consumer's dict
    (``delivery_p50``/``delivery_p99``) with the publisher's under
    ``publisher`` (its ``latency_p50``/``latency_p99``: publish -> confirm)."""
    ready = multiprocessing.get_context("fork").Event()
    c = spawn(consumer, port, queue, n, prefetch, stall=stall, keep_ids=False, ready=ready, stamps=True)
    if not ready.wait(stall):
        c.result(5)  # raises with what the consumer said, if it said anything
        raise RuntimeError(f"deliver_latency: no consume-ok on {queue} within {stall:.0f}s")
    p = spawn(publisher, port, queue, n, 1, stall=stall, stamp=True).result(timeout)
    return dict(c.result(timeout), publisher=p)


def cpu_count() -> int:
    return os.cpu_count() or 1
