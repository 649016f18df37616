"""Sync figures on a real 3-node cluster (loopback): the closing-note numbers
of issue #6.

    .venv/bin/python bench/sync.py [--messages 100000] [--repeats 2] [--serving 1]
                                   [--load-rate 0] [--before 5] [--delta 1000] [--delta-rounds 2]
                                   [--sync-batch-size 0] [--keep-logs]

A policy ``^sync\\.<queue>$`` ``{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}``
places each queue on node1 (master, client-local) and one mirror (waited for:
placement may start it a moment after the declare returns); the queue
gets ``--messages`` persistent 1 KiB messages (confirmed); then the policy
goes to ``exactly 3``: the master's node starts a replica on the third node
(StartReplica(join=True)), it joins the GM group unsynchronised and the
master streams its log by offset (:mod:`mirrorq.classic.sync`).

* ``idle``: nothing else runs; sync time = policy change -> the master's
  ``info()["sync"]`` shows both mirrors synchronised (polled every 20 ms;
  it includes placement and the new replica's start), and the transfer alone
  from the master's ``sync_started`` to its ``mirror_synchronised`` log
  records.  Records sent = the master's ``sync_records_sent`` delta.
* ``serving``: the same while one client process (its own channel on
  node1) publishes (100-message batches, confirms, at most 1000 unconfirmed;
  ``--load-rate`` msgs/s, 0 = as fast as it can) and consumes (prefetch 1000,
  acks on hand-over) from the same queue.  Its confirmed and delivered counts
  are sampled every ~50 ms; rate BEFORE = the ``--before`` seconds before
  the policy change, DURING = from the policy change to synchronised.
* ``delta``: kill -9 the node of a synchronised mirror, publish ``--delta``
  more messages, start the node again: placement brings the mirror back on
  it, the replica reopens its durable log and asks for the delta.  Reported:
  the master's ``sync_records_sent`` delta (about ``--delta``, not the whole
  queue, when it works), whether the master answered with a reset, and the
  time from the node's start to synchronised.

RabbitMQ (issue #6): 1.9 s for 100k x 1 KiB, with the queue blocked.
Prints tables and, last, one JSON line.  The cluster lives in a temp dir and
is always stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load import stop_load  # noqa: E402
from bench.mirrored_queue import BenchCluster, publish_confirmed  # noqa: E402
from ctl.mirrorctl import main as mirrorctl  # noqa: E402
from mirrorq.gm.shell import parse_member_name  # noqa: E402
from mirrorq.node import log as nodelog  # noqa: E402
from mirrorq.queues.client import ClientError, InternalClient  # noqa: E402

BODY = b"x" * 1024
NODES = 3


def spread(xs: list[float]) -> dict | None:
    if not xs:
        return None
    xs = sorted(xs)
    return {
        "median": statistics.median(xs),
        "min": xs[0],
        "max": xs[-1],
        "n": len(xs),
        "all": [round(x, 4) for x in xs],
    }


def fmt(s: dict | None, unit: str = "", prec: int = 2) -> str:
    if not s:
        return "-"
    f = f"{{:.{prec}f}}"
    return f"{f.format(s['median'])}{unit} (min {f.format(s['min'])}, max {f.format(s['max'])}, n={s['n']})"


def node_of(member: str) -> str:
    return parse_member_name(member).node


class Bench(BenchCluster):
    """The queue bench's throwaway cluster (1.5 s heartbeat timeout), plus policies."""

    def __init__(self, a):
        super().__init__(heartbeat_timeout=1.5)
        self.a = a

    def ctl(self, *argv: str) -> int:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = mirrorctl(["--data-dir", str(self.root), "--formatter", "json", *argv])
        return rc

    def policy(self, queue: str, n: int) -> None:
        definition = {"ha-mode": "exactly", "ha-params": n, "ha-sync-mode": "automatic"}
        if self.a.sync_batch_size:
            definition["ha-sync-batch-size"] = self.a.sync_batch_size
        d = json.dumps(definition)
        if (
            self.ctl("set_policy", "--apply-to", "queues", f"p-{queue}", f"^{queue.replace('.', chr(92) + '.')}$", d)
            != 0
        ):
            raise RuntimeError(f"set_policy for {queue} failed")

    def log_events(self, node: str, event: str, queue: str, since: float) -> list[dict]:
        return [
            r
            for r in nodelog.read(str(self.root / node))
            if r["event"] == event and r.get("queue") == queue and r["ts"] >= since
        ]


def synchronised(info: dict, want: int) -> bool:
    s = info.get("sync", {})
    return len(s) == want and all(v == "synchronised" for v in s.values())


def wait_synced(cl: InternalClient, q: str, want: int, timeout: float, pred=None) -> tuple[float, dict]:
    deadline = time.monotonic() + timeout
    last: dict = {}
    while time.monotonic() < deadline:
        try:
            last = cl.info(q, timeout=2.0)
        except ClientError:
            last = {}
        if last and synchronised(last, want) and (pred is None or pred(last)):
            return time.monotonic(), last
        time.sleep(0.02)  # polling interval of a condition with a deadline
    raise RuntimeError(f"{q}: not synchronised within {timeout}s; last info sync={last.get('sync')}")


def make_queue(b: Bench, cl: InternalClient, q: str) -> float:
    b.policy(q, 2)
    rec = cl.declare_queue(q, durable=True)
    if node_of(rec["pid"]) != b.nodes[0]:
        raise RuntimeError(f"{q}: unexpected placement {rec}")
    cl.open(q)
    wait_synced(cl, q, 1, 60)  # the mirror may be placed a moment after the declare returns
    rate = b.a.messages / publish_confirmed(cl, q, b.a.messages, 500, 5000)
    wait_synced(cl, q, 1, 60)
    return rate


def grow_and_time(b: Bench, cl: InternalClient, q: str) -> dict:
    i0 = cl.info(q)
    wall0, t0 = time.time(), time.monotonic()
    b.policy(q, 3)
    t1, i1 = wait_synced(cl, q, 2, 600)
    wall1 = time.time()
    master = b.nodes[0]
    started = b.log_events(master, "sync_started", q, wall0)
    done = b.log_events(master, "mirror_synchronised", q, wall0)
    transfer = done[-1]["ts"] - started[0]["ts"] if started and done else None
    return {
        "sync_s": t1 - t0,
        "transfer_s": transfer,
        "records": i1["sync_records_sent"] - i0["sync_records_sent"],
        "reset": [s.get("reset") for s in started],
        "messages": i1["messages"],
        "wall_policy": wall0,
        "wall_synced": wall1,
    }


# ---- the concurrent publisher + consumer -----------------------------------------------------
def _load(port: int, q: str, rate: float, ready, stop, samples) -> None:
    try:
        with InternalClient(port) as cl:
            cl.open(q)
            cl.consume(q, tag="load", prefetch=1000)
            ready.set()
            t0 = time.monotonic()
            delivered = 0
            last = 0.0
            while not stop.is_set():
                st = cl.confirms(q)
                now = time.monotonic()
                if now - last >= 0.05:
                    samples.put((time.time(), st["confirmed"], delivered, st["nacked"]))
                    last = now
                can = st["unconfirmed"] < 1000 and (rate <= 0 or st["published"] < rate * (now - t0))
                if can:
                    cl.publish(q, [BODY] * 100)
                delivered += len(cl.fetch(q, 2000))
                if not can:
                    time.sleep(0.005)  # flow control / pacing
            st = cl.wait_confirms(q, timeout=60)
            samples.put((time.time(), st["confirmed"], delivered, st["nacked"]))
            samples.put(("end", st))
    except Exception as e:  # reported by the parent
        ready.set()
        samples.put(("error", repr(e)))


def rate_between(samples: list, t0: float, t1: float) -> tuple[float, float]:
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if len(inside) < 2:
        return float("nan"), float("nan")
    a, z = inside[0], inside[-1]
    dt = z[0] - a[0]
    return (z[1] - a[1]) / dt, (z[2] - a[2]) / dt


def serving_run(b: Bench, q: str) -> dict:
    a = b.a
    with InternalClient(b.port(b.nodes[0])) as cl:
        fill_rate = make_queue(b, cl, q)
        ctx = multiprocessing.get_context("spawn")
        ready, stop, sq = ctx.Event(), ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=_load, args=(b.port(b.nodes[0]), q, a.load_rate, ready, stop, sq))
        samples: list = []
        end = None
        try:
            proc.start()
            ready.wait(60)
            time.sleep(a.before)
            res = grow_and_time(b, cl, q)
            time.sleep(1.0)
        finally:
            end = stop_load(stop, proc, sq, samples)
    if end is None or end[0] == "error" or end[1]["unconfirmed"] or end[1]["nacked"]:
        raise RuntimeError(f"{q}: the concurrent publisher/consumer failed: {end}")
    t_policy, t_sync = res.pop("wall_policy"), res.pop("wall_synced")
    before = rate_between(samples, t_policy - a.before + 0.5, t_policy)
    during = rate_between(samples, t_policy, t_sync)
    res.update(
        {
            "fill_rate": fill_rate,
            "pub_before": before[0],
            "con_before": before[1],
            "pub_during": during[0],
            "con_during": during[1],
        }
    )
    return res


def delta_round(b: Bench, cl: InternalClient, q: str) -> dict:
    a = b.a
    info = cl.info(q)
    mirrors = [m for m in info["sync"] if node_of(m) != b.nodes[0]]
    victim_member = sorted(mirrors)[-1]
    victim = node_of(victim_member)
    s0 = info["sync_records_sent"]
    b.cluster.kill_node(victim)
    cl.publish(q, [BODY] * a.delta)
    st = cl.wait_confirms(q, timeout=60)
    if st["unconfirmed"] or st["nacked"]:
        raise RuntimeError(f"{q}: publishing the delta: {st}")
    wall0, t0 = time.time(), time.monotonic()
    b.cluster.start_node(victim)
    t_started = time.monotonic()
    back = lambda i: any(node_of(m) == victim and m != victim_member for m in i["sync"])  # noqa: E731
    t1, i1 = wait_synced(cl, q, 2, 300, back)
    started = b.log_events(b.nodes[0], "sync_started", q, wall0)
    done = b.log_events(b.nodes[0], "mirror_synchronised", q, wall0)
    b.cluster.wait_all_up(b.nodes, timeout=60)
    return {
        "victim": victim,
        "records": i1["sync_records_sent"] - s0,
        "reset": [s.get("reset") for s in started],
        "start_offsets": [(s.get("start"), s.get("until")) for s in started],
        "node_start_s": t_started - t0,
        "start_to_synced_s": t1 - t_started,
        "transfer_s": done[-1]["ts"] - started[0]["ts"] if started and done else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--messages", type=int, default=100_000, help="messages in the queue before the sync")
    ap.add_argument("--repeats", type=int, default=2, help="idle syncs (a fresh queue each)")
    ap.add_argument("--serving", type=int, default=1, help="syncs under a concurrent publisher+consumer")
    ap.add_argument("--load-rate", type=float, default=0.0, help="publishes/s of the concurrent load (0: unthrottled)")
    ap.add_argument("--before", type=float, default=5.0, help="seconds of load before the sync starts")
    ap.add_argument("--delta", type=int, default=1000, help="messages published while a mirror's node is down")
    ap.add_argument("--delta-rounds", type=int, default=2)
    ap.add_argument(
        "--sync-batch-size", type=int, default=0, help="ha-sync-batch-size in the policy (0: the default, 4096)"
    )
    ap.add_argument("--keep-logs", action="store_true", help="keep the nodes' logs (always kept on a failure)")
    a = ap.parse_args()
    for name in ("messages", "delta"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    for name in ("repeats", "serving", "delta_rounds", "sync_batch_size"):
        if getattr(a, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    if a.before < 1:
        ap.error("--before must be >= 1 (seconds)")
    print(f"sync bench: 3 nodes on loopback, {os.cpu_count()} CPUs, {a.messages} x 1 KiB persistent", flush=True)
    result: dict = {"cpus": os.cpu_count(), "messages": a.messages, "idle": [], "serving": [], "delta": []}
    b = Bench(a)
    try:
        last_q = None
        for r in range(a.repeats):
            q = f"sync.idle{r}"
            with InternalClient(b.port(b.nodes[0])) as cl:
                fill_rate = make_queue(b, cl, q)
                res = grow_and_time(b, cl, q)
            res["fill_rate"] = fill_rate
            del res["wall_policy"], res["wall_synced"]
            result["idle"].append(res)
            last_q = q
            tr = f"{res['transfer_s']:.2f}" if res["transfer_s"] is not None else "-"
            print(
                f"  idle {r + 1}: filled at {fill_rate:.0f} msg/s; sync {res['sync_s']:.2f} s "
                f"(transfer {tr} s), {res['records']} records, reset={res['reset']}",
                flush=True,
            )
        for r in range(a.serving):
            q = f"sync.serving{r}"
            res = serving_run(b, q)
            result["serving"].append(res)
            print(
                f"  serving {r + 1}: sync {res['sync_s']:.2f} s (transfer {res['transfer_s']}), {res['records']} records; "
                f"publish {res['pub_before']:.0f} -> {res['pub_during']:.0f} msg/s, "
                f"consume {res['con_before']:.0f} -> {res['con_during']:.0f} msg/s (before -> during)",
                flush=True,
            )
            last_q = last_q or q
        if a.delta_rounds and last_q is None:
            last_q = "sync.delta"
            with InternalClient(b.port(b.nodes[0])) as cl:
                make_queue(b, cl, last_q)
                grow_and_time(b, cl, last_q)
        for r in range(a.delta_rounds):
            with InternalClient(b.port(b.nodes[0])) as cl:
                cl.open(last_q)
                res = delta_round(b, cl, last_q)
            result["delta"].append(res)
            print(
                f"  delta {r + 1}: {res['victim']} restarted after {a.delta} new messages: {res['records']} records sent, "
                f"reset={res['reset']} offsets={res['start_offsets']}, node start {res['node_start_s']:.2f} s, "
                f"then synchronised in {res['start_to_synced_s']:.2f} s",
                flush=True,
            )
    except BaseException:
        b.stop(keep_logs=True)
        raise
    else:
        b.stop(keep_logs=a.keep_logs)

    print()
    print("=== results ===")
    idle, serving, delta = result["idle"], result["serving"], result["delta"]
    summary = {
        "idle_sync_s": spread([x["sync_s"] for x in idle]),
        "idle_transfer_s": spread([x["transfer_s"] for x in idle if x["transfer_s"] is not None]),
        "serving_sync_s": spread([x["sync_s"] for x in serving]),
        "serving_transfer_s": spread([x["transfer_s"] for x in serving if x["transfer_s"] is not None]),
        "delta_records": spread([x["records"] for x in delta]),
    }
    result["summary"] = summary
    print(
        f"sync {a.messages} x 1 KiB, idle queue:   policy -> synchronised {fmt(summary['idle_sync_s'], ' s')}; "
        f"transfer {fmt(summary['idle_transfer_s'], ' s')}"
    )
    print(
        f"sync {a.messages} x 1 KiB, serving:      policy -> synchronised {fmt(summary['serving_sync_s'], ' s')}; "
        f"transfer {fmt(summary['serving_transfer_s'], ' s')}"
    )
    for x in serving:
        print(
            f"  rate before -> during sync: publish {x['pub_before']:.0f} -> {x['pub_during']:.0f} msg/s "
            f"({x['pub_during'] / x['pub_before']:.2f}x), consume {x['con_before']:.0f} -> {x['con_during']:.0f} msg/s "
            f"({x['con_during'] / x['con_before']:.2f}x)"
        )
    print(f"delta after {a.delta} new messages: records sent {fmt(summary['delta_records'], '', 0)}")
    print("RabbitMQ (issue #6): 1.9 s for 100k x 1 KiB, queue blocked")
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
