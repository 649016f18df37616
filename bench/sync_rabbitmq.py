"""bench/sync.py's figure against a real RabbitMQ 3.10: time to synchronise a
new mirror of a 100k x 1 KiB queue, and what a publisher and a consumer get
meanwhile (RabbitMQ's classic mirrored queue blocks while it syncs).

    .venv/bin/python bench/sync_rabbitmq.py [--messages 100000] [--modes automatic,manual]
                                            [--repeats 1] [--serving 1] [--before 5] [--keep]

One 3-node RabbitMQ cluster on loopback (bench/rabbitmq.py).  Per round a
fresh durable queue ``sync.<mode>.<kind><r>`` under a policy of its own,
``{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":<mode>}``, declared
through rabbit1 (its master there, the default locator client-local), gets
``--messages`` persistent 1 KiB messages (pika, pipelined confirms:
bench/clients.py's ``fill``); then the policy goes to ``exactly 3``
with the same ha-sync-mode: the third node gets a mirror.

* ``automatic``: the mirror syncs at once.
* ``manual``: the mirror starts unsynchronised; once ``list_queues`` shows it,
  ``rabbitmqctl sync_queue`` is run (it returns when the sync is done).

Figures per round:

* ``sync_s``: policy change (manual: ``sync_queue``) -> the first
  ``rabbitmqctl list_queues name slave_pids synchronised_slave_pids`` poll
  showing two synchronised mirrors.  Each poll is a CLI run (~1 s on an
  idle machine, several under load: ``poll_s``, timed just before), so this
  is coarse: it includes the ``set_policy`` run and at least one poll.
* ``log_policy_to_synced_s`` (automatic): the master's log, ``Successfully set
  policy`` -> ``Synchronising: complete`` (the mirror's start included).
* ``transfer_s``: the master's log, ``Synchronising: N messages to
  synchronise`` -> ``Synchronising: complete`` (millisecond timestamps);
  the figure comparable to sync.py's ``transfer``.
* ``serving`` rounds: a separate process (pika SelectConnection on rabbit1,
  one channel publishing 100-message bursts with confirms, at most 1000
  unconfirmed, one consuming with prefetch 1000, acks every 100) runs for
  ``--before`` seconds before the change; its confirmed and delivered counts
  are sampled every 50 ms.  Rate BEFORE = the ``--before`` window before the
  change (manual: before ``sync_queue``; the unsynchronised mirror exists then), DURING = the log's transfer window (start -> complete), and the
  longest stretch with no confirm at all (the blocked time).

mirrorq's figure (bench/sync.py, issue #6): the queue keeps serving while it
syncs.  Prints a table and, last, one JSON line.  The cluster is always
stopped.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pika  # noqa: E402

from bench.clients import fill  # noqa: E402
from bench.load import stop_load  # noqa: E402
from bench.rabbitmq import RabbitMQCluster, RabbitMQError, available  # noqa: E402

BODY = b"x" * 1024
PROPS = pika.BasicProperties(delivery_mode=2)
NODES = 3
# 2026-11-21 22:35:10.123456+00:00 [info] <0.123.0> Mirrored queue 'q' in vhost '/': Synchronising: complete
LOG_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+[+-]\d\d:\d\d) \[\w+\] <[^>]*> (.*)$")


def spread(xs: list[float]) -> dict | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return {
        "median": statistics.median(xs),
        "min": xs[0],
        "max": xs[-1],
        "n": len(xs),
        "all": [round(x, 3) for x in xs],
    }


def fmt(s: dict | None, unit: str = "", prec: int = 2) -> str:
    if not s:
        return "-"
    f = f"{{:.{prec}f}}"
    return f"{f.format(s['median'])}{unit} (min {f.format(s['min'])}, max {f.format(s['max'])}, n={s['n']})"


def log_events(rmq: RabbitMQCluster, queue: str, since: float) -> list[tuple[float, str]]:
    """(epoch, text) of the master's (rabbit1's) log lines about ``queue`` from ``since``."""
    out = []
    try:
        lines = rmq.node_log(0).read_text(errors="replace").splitlines()
    except OSError:
        return out
    needles = (f"queue '{queue}' in vhost '/'", f"set policy 'p-{queue}'")
    for ln in lines:
        m = LOG_RE.match(ln)
        if m and any(n in m.group(2) for n in needles):
            ts = datetime.fromisoformat(m.group(1)).timestamp()
            if ts >= since:
                out.append((ts, m.group(2)))
    return out


def transfer_window(rmq: RabbitMQCluster, queue: str, since: float, timeout: float = 10) -> tuple:
    """(policy set, start, complete, messages) of the sync that moved messages, from the master's log.

    RabbitMQ logs ``Synchronising: N messages to synchronise`` each time it
    considers syncing (also when ``all mirrors already synced``); the real one
    is followed by ``mirrors [...] to sync`` and ends with ``complete``.  The
    log is written asynchronously: this waits up to ``timeout`` for the lines.
    """
    deadline = time.monotonic() + timeout
    while True:
        ev = log_events(rmq, queue, since)
        pol = start = done = n = None
        for i, (_t, s) in enumerate(ev):
            if "Synchronising: mirrors [" in s:
                head = [(tt, ss) for tt, ss in ev[:i] if "messages to synchronise" in ss]
                tail = [tt for tt, ss in ev[i:] if "Synchronising: complete" in ss]
                if head and tail:
                    start, done = head[-1][0], tail[0]
                    pols = [tt for tt, ss in ev[:i] if "Successfully set policy" in ss]
                    pol = pols[-1] if pols else None
                    n = int(re.search(r"Synchronising: (\d+) messages", head[-1][1]).group(1))
                break
        if done is not None or time.monotonic() > deadline:
            return pol, start, done, n
        time.sleep(0.1)  # waiting for the logger's flush, with a deadline


def sync_state(rmq: RabbitMQCluster, queue: str) -> tuple[int, int]:
    for q in rmq.list_queues("name", "slave_pids", "synchronised_slave_pids"):
        if q["name"] == queue:
            return len(q["slave_pids"] or []), len(q["synchronised_slave_pids"] or [])
    raise RabbitMQError(f"{queue} is not in list_queues")


def wait_state(rmq: RabbitMQCluster, queue: str, pred, timeout: float) -> tuple[float, tuple[int, int]]:
    deadline = time.monotonic() + timeout
    st = (-1, -1)
    while time.monotonic() < deadline:
        st = sync_state(rmq, queue)
        if pred(st):
            return time.monotonic(), st
    raise RabbitMQError(f"{queue}: (mirrors, synchronised mirrors) still {st} after {timeout} s")


def policy(rmq: RabbitMQCluster, queue: str, n: int, mode: str) -> None:
    rmq.set_policy(
        f"p-{queue}", "^" + re.escape(queue) + "$", {"ha-mode": "exactly", "ha-params": n, "ha-sync-mode": mode}
    )


# ---- the concurrent publisher + consumer (its own process) -----------------------------------
def _load(port: int, queue: str, ready, stop, samples, consume: bool = True) -> None:
    """Publish (and with ``consume`` also consume) until ``stop``; samples (time, confirmed, delivered, nacked)."""
    st = {"published": 0, "confirmed": 0, "nacked": 0, "delivered": 0, "unacked": 0}
    try:

        def pump():
            pch = st.get("pch")
            if pch is None or stop.is_set():
                return
            while st["published"] - st["confirmed"] - st["nacked"] <= 900:
                for _ in range(100):
                    pch.basic_publish("", queue, BODY, PROPS)
                st["published"] += 100

        def on_confirm(frame):
            m = frame.method
            k = "confirmed" if isinstance(m, pika.spec.Basic.Ack) else "nacked"
            if m.multiple:
                done = m.delivery_tag - st["confirmed"] - st["nacked"]
                st[k] += max(0, done)
            else:
                st[k] += 1
            pump()

        def on_deliver(ch, method, props, body):
            st["delivered"] += 1
            st["unacked"] += 1
            if st["unacked"] >= 100:
                ch.basic_ack(method.delivery_tag, multiple=True)
                st["unacked"] = 0

        def on_pub(ch):
            def selected(_):
                st["pch"] = ch
                maybe_ready()
                pump()

            ch.confirm_delivery(on_confirm, callback=selected)

        def on_con(ch):
            def qos_ok(_):
                ch.basic_consume(queue, on_deliver)
                st["cch"] = ch
                maybe_ready()

            ch.basic_qos(prefetch_count=1000, callback=qos_ok)

        def maybe_ready():
            if "pch" in st and ("cch" in st or not consume):
                ready.set()
                sample()

        def sample():
            samples.put((time.time(), st["confirmed"], st["delivered"], st["nacked"]))
            if stop.is_set():
                if (
                    st["confirmed"] + st["nacked"] >= st["published"]
                    or time.monotonic() > st.setdefault("t_stop", time.monotonic()) + 60
                ):
                    samples.put(("end", {k: v for k, v in st.items() if isinstance(v, int)}))
                    conn.close()
                    return
            conn.ioloop.call_later(0.05, sample)

        def on_open(c):
            c.channel(on_open_callback=on_pub)
            if consume:
                c.channel(on_open_callback=on_con)

        conn = pika.SelectConnection(pika.ConnectionParameters("127.0.0.1", port), on_open_callback=on_open)
        conn.add_on_close_callback(lambda *a: conn.ioloop.stop())
        conn.ioloop.start()
    except Exception as e:  # reported by the parent
        ready.set()
        samples.put(("error", repr(e)))


def rate_between(samples: list, t0: float, t1: float) -> tuple[float, float]:
    """(confirmed/s, delivered/s) from the last sample at or before t0 to the first at or after t1."""
    a = [s for s in samples if s[0] <= t0]
    z = [s for s in samples if s[0] >= t1]
    if not a or not z or z[0][0] <= a[-1][0]:
        return float("nan"), float("nan")
    a, z = a[-1], z[0]
    dt = z[0] - a[0]
    return (z[1] - a[1]) / dt, (z[2] - a[2]) / dt


def longest_stall(samples: list, t0: float, t1: float, col: int) -> float:
    """Longest interval within [t0 - 1, t1 + 1] in which column ``col`` (1 confirmed, 2 delivered) did not move."""
    inside = [s for s in samples if t0 - 1 <= s[0] <= t1 + 1]
    best, since = 0.0, None
    for a, b in zip(inside, inside[1:]):
        if b[col] == a[col]:
            since = a[0] if since is None else since
            best = max(best, b[0] - since)
        else:
            since = None
    return best


# ---- one round -------------------------------------------------------------------------------
def one_round(rmq: RabbitMQCluster, a, mode: str, queue: str, serving: bool) -> dict:
    port = rmq.amqp_port(0)
    policy(rmq, queue, 2, mode)
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    conn.channel().queue_declare(queue, durable=True)
    conn.close()
    fill_rate = fill(port, queue, a.messages, 500)["rate"]
    wait_state(rmq, queue, lambda s: s == (1, 1), 120)
    proc = sq = stop = None
    samples: list = []
    end = None
    if serving:
        ctx = multiprocessing.get_context("spawn")
        ready, stop, sq = ctx.Event(), ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=_load, args=(port, queue, ready, stop, sq), daemon=True)
        proc.start()
        ready.wait(60)
        time.sleep(a.before)  # the load runs alone for --before seconds
    try:
        tp = time.monotonic()
        sync_state(rmq, queue)
        poll_s = time.monotonic() - tp  # what one rabbitmqctl poll costs right now
        wall0, t0 = time.time(), time.monotonic()
        policy(rmq, queue, 3, mode)
        sync_cmd_s, unsynced = None, None
        if mode == "manual":
            wait_state(rmq, queue, lambda s: s[0] == 2, 120)
            # (with a consumer, a manual mirror also becomes synchronised once the old messages are consumed)
            unsynced = sync_state(rmq, queue) == (2, 1)
            wall0, t0 = time.time(), time.monotonic()
            rmq.ctl("sync_queue", queue, timeout=600)
            sync_cmd_s = time.monotonic() - t0
        t1, _ = wait_state(rmq, queue, lambda s: s == (2, 2), 600)
        wall1 = time.time()
        time.sleep(1.0 if serving else 0)  # the load goes on a moment after the sync
    finally:
        if serving:
            end = stop_load(stop, proc, sq, samples)
    t_pol, start, done, n_synced = transfer_window(rmq, queue, wall0 - 2)
    res = {
        "mode": mode,
        "queue": queue,
        "serving": serving,
        "fill_rate": fill_rate,
        "sync_s": t1 - t0,
        "poll_s": poll_s,
        "sync_queue_cmd_s": sync_cmd_s,
        "transfer_s": (done - start) if start and done else None,
        "log_policy_to_synced_s": (done - t_pol) if mode == "automatic" and t_pol and done else None,
        "messages_synchronised": n_synced,
        "unsynchronised_before": unsynced,
    }
    if serving:
        if end is None or end[0] == "error" or end[1]["nacked"]:
            raise RabbitMQError(f"{queue}: the concurrent publisher/consumer failed: {end}")
        w0, w1 = (start, done) if start and done else (wall0, wall1)
        before = rate_between(samples, wall0 - a.before + 0.5, wall0)
        during = rate_between(samples, w0, w1)
        res.update(
            {
                "pub_before": before[0],
                "con_before": before[1],
                "pub_during": during[0],
                "con_during": during[1],
                "publish_stall_s": longest_stall(samples, w0, w1, 1),
                "consume_stall_s": longest_stall(samples, w0, w1, 2),
                "load_end": end[1],
            }
        )
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    conn.channel().queue_delete(queue)
    conn.close()
    rmq.ctl("clear_policy", f"p-{queue}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--modes", default="automatic,manual", help="ha-sync-mode values to run, comma-separated")
    ap.add_argument("--repeats", type=int, default=1, help="idle rounds per mode")
    ap.add_argument("--serving", type=int, default=1, help="rounds per mode under a concurrent publisher+consumer")
    ap.add_argument("--before", type=float, default=5.0, help="seconds of load before the sync starts")
    ap.add_argument("--keep", action="store_true", help="keep the RabbitMQ dir (logs) after the run")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in ("automatic", "manual")]
    if bad:
        ap.error(f"--modes: unknown ha-sync-mode {bad} (automatic, manual)")
    if a.messages < 1:
        ap.error("--messages must be >= 1")
    if a.repeats < 0 or a.serving < 0:
        ap.error("--repeats and --serving must be >= 0")
    if a.before < 1:
        ap.error("--before must be >= 1 (seconds)")
    why = available()
    if why:
        raise SystemExit(why)
    la = os.getloadavg()
    print(
        f"RabbitMQ sync bench: {NODES} nodes on loopback, {os.cpu_count()} CPUs, {a.messages} x 1 KiB persistent, "
        f"loadavg {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}",
        flush=True,
    )
    rounds: list[dict] = []
    t_start = time.monotonic()
    with RabbitMQCluster(NODES, keep=a.keep) as rmq:
        print(f"  cluster up in {time.monotonic() - t_start:.1f} s ({rmq.root})", flush=True)
        for mode in modes:
            for kind, count in (("idle", a.repeats), ("serving", a.serving)):
                for r in range(count):
                    res = one_round(rmq, a, mode, f"sync.{mode}.{kind}{r}", kind == "serving")
                    rounds.append(res)
                    tr = f"{res['transfer_s']:.2f}" if res["transfer_s"] is not None else "-"
                    lp = res["log_policy_to_synced_s"]
                    line = (
                        f"  {mode} {kind} {r + 1}: filled at {res['fill_rate']:.0f} msg/s; sync {res['sync_s']:.2f} s by polls "
                        f"(one poll {res['poll_s']:.2f} s)"
                        + (f", {lp:.2f} s policy -> complete in the log" if lp is not None else "")
                        + f" (transfer {tr} s, {res['messages_synchronised']} messages)"
                    )
                    if res["sync_queue_cmd_s"] is not None:
                        line += f"; sync_queue returned after {res['sync_queue_cmd_s']:.2f} s"
                    if kind == "serving":
                        line += (
                            f"; publish {res['pub_before']:.0f} -> {res['pub_during']:.0f} msg/s, consume "
                            f"{res['con_before']:.0f} -> {res['con_during']:.0f} msg/s (before -> during), "
                            f"no confirm for {res['publish_stall_s']:.2f} s, no delivery for {res['consume_stall_s']:.2f} s"
                        )
                    print(line + f"  [loadavg {os.getloadavg()[0]:.2f}]", flush=True)
    la = os.getloadavg()
    print()
    print("=== results (RabbitMQ 3.10.8, 3 nodes, exactly 2 -> exactly 3) ===")
    summary = {}
    for mode in modes:
        for kind in ("idle", "serving"):
            rs = [r for r in rounds if r["mode"] == mode and r["serving"] == (kind == "serving")]
            if not rs:
                continue
            s = {
                "sync_s": spread([r["sync_s"] for r in rs]),
                "transfer_s": spread([r["transfer_s"] for r in rs]),
                "log_policy_to_synced_s": spread([r["log_policy_to_synced_s"] for r in rs]),
            }
            summary[f"{mode}_{kind}"] = s
            print(
                f"sync {a.messages} x 1 KiB, {mode:9s} {kind:7s}: to synchronised (polls) {fmt(s['sync_s'], ' s')}; "
                f"policy -> complete (log) {fmt(s['log_policy_to_synced_s'], ' s')}; transfer (log) {fmt(s['transfer_s'], ' s')}"
            )
            for r in rs:
                if r["serving"]:
                    print(
                        f"  rate before -> during sync: publish {r['pub_before']:.0f} -> {r['pub_during']:.0f} msg/s "
                        f"({r['pub_during'] / r['pub_before']:.2f}x), consume {r['con_before']:.0f} -> "
                        f"{r['con_during']:.0f} msg/s ({r['con_during'] / r['con_before']:.2f}x); longest stretch "
                        f"without a confirm {r['publish_stall_s']:.2f} s, without a delivery {r['consume_stall_s']:.2f} s"
                    )
    print(f"loadavg at end {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    print(
        json.dumps(
            {"cpus": os.cpu_count(), "messages": a.messages, "loadavg_end": la, "rounds": rounds, "summary": summary},
            default=str,
        )
    )


if __name__ == "__main__":
    main()
