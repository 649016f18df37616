"""A publisher faster than the cluster, without confirms and without a consumer:
mirrorq and RabbitMQ 3.10 in the same run (issue #30's case and its item 7).

    .venv/bin/python bench/overload.py [--messages 500000] [--size 4096] [--publishers 1]
                                      [--sides mirrorq,rabbitmq] [--pause-mirror SECONDS]
                                      [--queue-type classic|quorum]

Each side is a fresh 3-node cluster on loopback with the ``^mirrored\\.``
queues mirrored on every node (``ha-mode: all``, automatic sync: the same
policy as bench/amqp.py).  One durable queue ``mirrored.overload`` is
declared on node 1, where every client connects (with ``--queue-type
quorum``: a quorum queue ``quorum.overload`` on the 3 nodes).  Then:

1. *accept*: ``--publishers`` pika ``BlockingConnection`` processes publish
   ``--messages`` persistent messages of ``--size`` bytes in all, as fast
   as the broker reads them, with no confirms, and close their connection
   (close-ok).  The time is from the first publish to the last close-ok.
   With ``--pause-mirror S``, node 3's whole process group is stopped
   (SIGSTOP) 2 s into the accept phase for S seconds, then resumed.
2. *settle*: the queue's depth is polled (a passive declare each second)
   until it holds every message or stops changing for 60 s: ``kept`` is
   that depth, ``lost`` what is missing.
3. *drain*: one consumer (prefetch 1000, one ack per message) takes the
   whole backlog; its time and rate are reported.

Throughout, the resident memory of each node's process group is sampled
every 0.25 s (``/proc``, every process of the group: for mirrorq a node's
admin, actors and shells; for RabbitMQ its ``beam.smp`` and helpers).  The
table gives each phase's figures and each node's peak; the last line is
one JSON object with everything.  Every process started is stopped by its
recorded process group, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pika  # noqa: E402

from bench import clients  # noqa: E402
from bench.amqp import MirrorqSide, RabbitMQSide  # noqa: E402
from bench.rabbitmq import available  # noqa: E402
from mirrorq.node.daemon import group_rss  # noqa: E402

QUEUE = "mirrored.overload"
QUORUM_QUEUE = "quorum.overload"  # --queue-type quorum: a 3-member quorum queue instead
SAMPLE_EVERY = 0.25
SETTLE_STILL = 60.0  # the depth stopped changing for this long: what is there is all there is
MiB = 1 << 20


def blast(port: int, queue: str, n: int, size: int, tag: str, start_at: float = 0.0) -> dict:
    """Publish ``n`` persistent messages of ``size`` bytes without confirms
    (pika's BlockingConnection writes each one before returning), then
    close the connection and wait for close-ok."""
    clients._wait_until(start_at)
    params = pika.ConnectionParameters("127.0.0.1", port, heartbeat=0, blocked_connection_timeout=None)
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    props = pika.BasicProperties(delivery_mode=2)
    blocked = {"n": 0}
    conn.add_on_connection_blocked_callback(lambda *_: blocked.__setitem__("n", blocked["n"] + 1))
    t0 = time.monotonic()
    sent = 0
    error = None
    try:
        for i in range(n):
            ch.basic_publish("", queue, clients.body_for(tag, i + 1, size), props)
            sent += 1
        conn.close()  # connection.close -> close-ok: the broker has taken everything before it
    except Exception as e:  # noqa: BLE001 -- reported, the bench decides
        error = f"{type(e).__name__}: {e}"
    return {"sent": sent, "t0": t0, "t1": time.monotonic(), "error": error, "blocked": blocked["n"]}


def depth(port: int, queue: str) -> int | None:
    try:
        conn = pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", port, heartbeat=0, socket_timeout=10, blocked_connection_timeout=30)
        )
    except Exception:  # noqa: BLE001 -- the broker is busy: try again
        return None
    try:
        ok = conn.channel().queue_declare(queue, passive=True)
        return ok.method.message_count
    except Exception:  # noqa: BLE001
        return None
    finally:
        with contextlib.suppress(Exception):
            conn.close()


class Sampler(threading.Thread):
    """Each node's process-group RSS every SAMPLE_EVERY seconds: the peak and a
    coarse timeline (one point a second)."""

    def __init__(self, groups: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.groups = groups
        self.peak = {n: 0 for n in groups}
        self.timeline: list = []
        self.stop = threading.Event()

    def run(self) -> None:
        last = 0.0
        while not self.stop.wait(SAMPLE_EVERY):
            now = time.monotonic()
            sample = {n: group_rss(g) for n, g in self.groups.items()}
            for n, v in sample.items():
                self.peak[n] = max(self.peak[n], v)
            if now - last >= 1.0:
                last = now
                self.timeline.append((round(now, 1), {n: v // MiB for n, v in sample.items()}))


def groups_of(side) -> dict[str, int]:
    if isinstance(side, MirrorqSide):
        return {n: int(side.cluster.pid_info(n)["pgid"]) for n in side.cluster.node_names()}
    return {n: p.pid for n, p in side.rmq.procs.items()}


def run_side(side, a) -> dict:
    quorum = a.queue_type == "quorum"
    queue = QUORUM_QUEUE if quorum else QUEUE
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", side.port, heartbeat=0))
    conn.channel().queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"} if quorum else None)
    conn.close()
    deadline = time.monotonic() + 60
    while not quorum and side.synced_mirrors().get(queue, 0) < 2:  # a quorum queue has its members at once
        if time.monotonic() > deadline:
            raise RuntimeError(f"{side.name}: {QUEUE} has no 2 synchronised mirrors after 60 s")
        time.sleep(0.2)
    groups = groups_of(side)
    sampler = Sampler(groups)
    sampler.start()
    res: dict = {"side": side.name}
    try:
        start = time.time() + 0.5
        per = [a.messages // a.publishers + (1 if i < a.messages % a.publishers else 0) for i in range(a.publishers)]
        pubs = [clients.spawn(blast, side.port, queue, k, a.size, f"p{i}", start) for i, k in enumerate(per)]
        paused = None
        if a.pause_mirror:
            time.sleep(max(0.0, start - time.time()) + 2.0)
            victim = list(groups.values())[2]
            os.killpg(victim, signal.SIGSTOP)
            try:
                time.sleep(a.pause_mirror)
            finally:
                os.killpg(victim, signal.SIGCONT)
            paused = a.pause_mirror
        outs = [p.result(a.timeout) for p in pubs]
        t0 = min(o["t0"] for o in outs)
        t1 = max(o["t1"] for o in outs)
        sent = sum(o["sent"] for o in outs)
        res.update(
            accept_s=t1 - t0,
            sent=sent,
            errors=[o["error"] for o in outs if o["error"]],
            blocked=sum(o["blocked"] for o in outs),
            paused_mirror_s=paused,
            accept_peak=dict(sampler.peak),
        )
        # settle: the queue holds what it was given, or stops changing
        last, still_since, kept = None, time.monotonic(), None
        while True:
            d = depth(side.port, queue)
            now = time.monotonic()
            if d is not None:
                kept = d
                if d != last:
                    last, still_since = d, now
                if d >= sent:
                    break
            if now - still_since > SETTLE_STILL:
                break
            time.sleep(1.0)
        res.update(settle_s=time.monotonic() - t1, kept=kept, lost=sent - (kept or 0))
        dr = clients.drain(side.port, queue, kept or 0, 1000, stall=60.0, timeout=a.timeout) if kept else {}
        res.update(
            drain_s=(dr.get("t1", 0) - dr.get("t0", 0)) if dr else 0.0,
            drained=dr.get("consumed", 0),
            drain_rate=dr.get("rate", 0.0),
            drain_error=dr.get("stalled") or dr.get("error"),
        )
    finally:
        sampler.stop.set()
        sampler.join()
    res.update(peak_mib={n: v // MiB for n, v in sampler.peak.items()}, timeline=sampler.timeline[::5])
    return res


def table(results: list, a) -> list[str]:
    gb = a.messages * a.size / 1e9
    lines = [
        f"{a.queue_type} queue, {a.messages} messages of {a.size} B ({gb:.2f} GB), {a.publishers} "
        f"publisher(s), no confirms, "
        f"no consumer{f', node 3 stopped {a.pause_mirror:.0f} s' if a.pause_mirror else ''}",
        f"{'side':10} {'accept s':>9} {'MB/s':>7} {'kept':>9} {'lost':>7} {'settle s':>9} "
        f"{'drain s':>8} {'drain/s':>8}  peak RSS per node (MiB)",
    ]
    for r in results:
        mbs = r["sent"] * a.size / 1e6 / r["accept_s"] if r.get("accept_s") else 0.0
        peaks = " ".join(f"{v}" for v in r["peak_mib"].values())
        lines.append(
            f"{r['side']:10} {r['accept_s']:9.1f} {mbs:7.1f} {r['kept'] or 0:9d} {r['lost']:7d} "
            f"{r['settle_s']:9.1f} {r['drain_s']:8.1f} {r['drain_rate']:8.0f}  {peaks}"
        )
        for e in r["errors"] + ([r["drain_error"]] if r.get("drain_error") else []):
            lines.append(f"    {r['side']}: {e}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=500_000)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--publishers", type=int, default=1)
    ap.add_argument("--sides", default="mirrorq,rabbitmq")
    ap.add_argument("--pause-mirror", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--queue-type", choices=("classic", "quorum"), default="classic")
    a = ap.parse_args()
    results = []
    for name in a.sides.split(","):
        if name == "rabbitmq" and available():
            print(f"RabbitMQ skipped: {available()}", flush=True)
            continue
        side_cls = MirrorqSide if name == "mirrorq" else RabbitMQSide
        with side_cls() as side:
            r = run_side(side, a)
        results.append(r)
        print("\n".join(table([r], a)[2:]), flush=True)
    print()
    print("\n".join(table(results, a)))
    print(json.dumps({"args": vars(a), "results": results}))
    sys.exit(0 if all(r["lost"] == 0 and not r["errors"] for r in results) else 1)


if __name__ == "__main__":
    main()
