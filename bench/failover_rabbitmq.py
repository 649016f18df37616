"""bench/mirrored_queue.py's failover figure against a real RabbitMQ 3.10:
kill -9 the node of a mirrored queue's master, time to the first confirm of a
publish sent after the kill.

    .venv/bin/python bench/failover_rabbitmq.py [--rounds 3]

One 3-node RabbitMQ cluster on loopback (bench/rabbitmq.py), policy
``{"ha-mode":"all"}`` (ha-promote-on-failure: always, the default).  Per
round a fresh durable queue is declared through the victim node (its master
there: client-local); a publisher process (pika SelectConnection on a
survivor; 100-message bursts, persistent 1 KiB, confirms, at most 1000
unconfirmed) runs until 2000 are confirmed; then the victim node's process
group gets SIGKILL and a second channel on a survivor (opened before, with
confirms) publishes one marker message: failover = kill -> the marker's
confirm (pika's BlockingChannel.basic_publish returns when it is acked).
Also reported from the survivors' logs: the node-down record and the
promotion of a mirror (ms after the kill).  The publisher's confirms are
checked afterwards (nacks counted).  The victim rotates over the nodes and
is restarted between rounds.

Erlang distribution sees a killed node's TCP connections close at once, so
detection here is not net_ticktime (60 s) but a socket's EOF: a hard kill on
one host.  mirrorq's figure: bench/mirrored_queue.py (heartbeat timeouts).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pika  # noqa: E402

from bench.load import stop_load, wait_confirmed  # noqa: E402
from bench.rabbitmq import RabbitMQCluster, RabbitMQError, available  # noqa: E402
from bench.sync_rabbitmq import LOG_RE, _load  # noqa: E402

NODES = 3


def log_first(rmq: RabbitMQCluster, nodes: list[int], pred, since: float) -> float | None:
    """Earliest epoch (>= since) of a log line satisfying pred on any of ``nodes``."""
    best = None
    for i in nodes:
        try:
            lines = rmq.node_log(i).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for ln in lines:
            m = LOG_RE.match(ln)
            if m and pred(m.group(2)):
                ts = datetime.fromisoformat(m.group(1)).timestamp()
                if ts >= since:
                    best = ts if best is None else min(best, ts)
                    break
    return best


def one_round(rmq: RabbitMQCluster, r: int) -> dict:
    vi = r % NODES
    si = (r + 1) % NODES
    victim = rmq.names[vi]
    q = f"failover-{r}"
    c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", rmq.amqp_port(vi)))
    c.channel().queue_declare(q, durable=True)
    c.close()
    deadline = time.monotonic() + 60
    while True:  # the mirrors start asynchronously
        st = [x for x in rmq.list_queues("name", "pid", "slave_pids", "synchronised_slave_pids") if x["name"] == q][0]
        if len(st["synchronised_slave_pids"] or []) == NODES - 1:
            break
        if time.monotonic() > deadline:
            raise RabbitMQError(f"{q}: mirrors not synchronised: {st}")
    mconn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", rmq.amqp_port(si)))
    mch = mconn.channel()
    mch.confirm_delivery()
    ctx = multiprocessing.get_context("spawn")
    ready, stop, sq = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_load, args=(rmq.amqp_port(si), q, ready, stop, sq, False), daemon=True)
    samples: list = []
    end = None
    t_conf = None
    try:
        proc.start()
        try:
            wait_confirmed(sq, samples, ready, 2000, q)
        except RuntimeError as e:
            raise RabbitMQError(str(e)) from None
        wall_kill, t_kill = time.time(), time.monotonic()
        rmq.kill_node(vi)
        mch.basic_publish("", q, b"marker", pika.BasicProperties(delivery_mode=2))
        t_conf = time.monotonic()
    finally:
        end = stop_load(stop, proc, sq, samples)
        try:
            mconn.close()
        except Exception:
            pass
    survivors = [i for i in range(NODES) if i != vi]
    down = log_first(rmq, survivors, lambda s: f"node {victim} down" in s or f"{victim} down" in s.lower(), wall_kill)
    prom = log_first(rmq, survivors, lambda s: f"queue '{q}'" in s and "Promoting" in s, wall_kill)
    rmq.start_node(vi)
    rmq.await_node(vi)
    c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", rmq.amqp_port(si)))
    c.channel().queue_delete(q)
    c.close()
    if end is None or end[0] == "error":
        raise RabbitMQError(f"{q}: publisher failed: {end}")
    return {
        "victim": victim,
        "failover_s": t_conf - t_kill,
        "node_down_s": (down - wall_kill) if down else None,
        "promoted_s": (prom - wall_kill) if prom else None,
        "publisher": end[1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the RabbitMQ dir (logs) after the run")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    why = available()
    if why:
        raise SystemExit(why)
    la = os.getloadavg()
    print(
        f"RabbitMQ failover bench: {NODES} nodes, ha-mode all, {os.cpu_count()} CPUs, "
        f"loadavg {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}",
        flush=True,
    )
    rows = []
    with RabbitMQCluster(NODES, policy=("ha-all", "^failover-", {"ha-mode": "all"}), keep=a.keep) as rmq:
        for r in range(a.rounds):
            x = one_round(rmq, r)
            rows.append(x)
            ms = lambda v: f"{v * 1000:.0f}" if v is not None else "-"  # noqa: E731
            p = x["publisher"]
            print(
                f"  round {r + 1}: kill -9 {x['victim']}: failover {ms(x['failover_s'])} ms (node down logged at "
                f"{ms(x['node_down_s'])} ms, promotion at {ms(x['promoted_s'])} ms); publisher {p['published']} "
                f"published, {p['confirmed']} confirmed, {p['nacked']} nacked  [loadavg {os.getloadavg()[0]:.2f}]",
                flush=True,
            )
    xs = sorted(x["failover_s"] for x in rows)
    summary = {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}
    print()
    print(
        f"RabbitMQ failover (kill -9 master's node -> 1st confirm of a new publish): median "
        f"{summary['median'] * 1000:.0f} ms (min {summary['min'] * 1000:.0f}, max {summary['max'] * 1000:.0f}, "
        f"n={summary['n']}); loadavg at end {' '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )
    print(json.dumps({"cpus": os.cpu_count(), "rounds": rows, "failover_s": summary, "loadavg_end": os.getloadavg()}))


if __name__ == "__main__":
    main()
