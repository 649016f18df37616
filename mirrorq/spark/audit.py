"""audit: check a cluster run's histories with Spark (``mirrorctl audit``).

Inputs
------
* **Node histories**: every node's ``node.log`` (JSON lines, see
  :mod:`mirrorq.node.log`).  Used: ``history`` (the master's operations, one
  line per batch: publish ``[[offset, publisher, seq, ref, ref_seq]]``,
  deliver, ack, requeue -- :mod:`mirrorq.classic.history`),
  ``history_confirm``, ``history_nack``, ``stream_commit``,
  ``view_change``, ``promoted``, ``node_down`` / ``node_up``,
  ``sync_started`` / ``mirror_synchronised``.
* **Client histories** (what a test or the nemesis harness writes; the
  truth of what was acknowledged).  One JSON object per line::

    {"type": "invoke"|"ok"|"fail"|"info", "f": "publish"|"consume"|"kill"|"start"|...,
     "process": "<client id>", "publisher": "<publisher id>", "seq": 7,
     "value": "<message value>", "time": 1700000000.123, "queue": "q",
     "redelivered": false, "node": "node2"}

  - ``publish``: ``invoke`` when the client sends it; ``ok`` when it is
    confirmed (basic.ack); ``fail`` when it definitely did not happen
    (basic.nack, refused); ``info`` when the outcome is unknown (the
    connection died before the confirm).  ``value`` identifies the message
    (unique per run), ``publisher`` + ``seq`` (1, 2, 3... per publisher, in
    send order) identify it too.
  - ``consume``: one ``ok`` per message received (``basic.deliver``,
    ``basic.get-ok``, a range read), with the ``value``, the message's
    ``publisher`` and ``seq`` (from its headers) and ``redelivered``;
    ``process`` is the consumer.  A final drain is consumes like any other.
  - nemesis events: ``{"type": "info", "f": "kill"|"start"|"partition"|"heal",
    "value": "<node>", "time": ...}``.
  - ``time``: seconds since the epoch (wall clock, as the nodes' ``ts``).

Checks (Jepsen's total-queue, by value)
---------------------------------------
* **lost**: a publish ``ok`` whose value was never consumed -> FAIL.
* **unexpected**: a consumed value no publish was invoked for -> FAIL.
* **duplicated**: a value consumed more than once (legal under
  at-least-once delivery: reported, with how many were redeliveries).
* **reordered**: per (consumer, publisher), a first delivery
  (``redelivered`` false) whose seq is below an earlier one's -> reported
  (FIFO per publisher is what a classic queue promises a lone consumer).
* **recovered** (info publishes that were consumed) and **unconfirmed**
  counts; the node histories' publishes per second and confirms, and the
  failover windows (a ``kill`` or ``node_down`` to the next ``promoted``).
* Confirm latency (publish invoke -> ok) percentiles per time bucket.

The verdict is *valid* when nothing is lost and nothing unexpected.

Outputs: ``report.md`` (verdict, counts, examples, latency table, failover
windows) and ``timeline.png`` (throughput, confirm latency p50/p99, kills
and promotions).  Runs on ``local[*]`` by default; ``--master`` for any
Spark cluster (then the paths must be readable by its executors).
"""

from __future__ import annotations

import glob
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

CLIENT_FIELDS = [
    ("type", "string"),
    ("f", "string"),
    ("process", "string"),
    ("publisher", "string"),
    ("seq", "long"),
    ("value", "string"),
    ("time", "double"),
    ("queue", "string"),
    ("redelivered", "boolean"),
    ("node", "string"),
]
EXAMPLES = 10


def client_schema():
    from pyspark.sql.types import BooleanType, DoubleType, LongType, StringType, StructField, StructType

    kinds = {"string": StringType(), "long": LongType(), "double": DoubleType(), "boolean": BooleanType()}
    return StructType([StructField(n, kinds[t], True) for n, t in CLIENT_FIELDS])


def node_schema():
    from pyspark.sql.types import ArrayType, DoubleType, LongType, StringType, StructField, StructType

    return StructType(
        [
            StructField("ts", DoubleType()),
            StructField("node", StringType()),
            StructField("event", StringType()),
            StructField("queue", StringType()),
            StructField("member", StringType()),
            StructField("publish", ArrayType(ArrayType(StringType()))),
            StructField("confirm", ArrayType(ArrayType(StringType()))),
            StructField("nack", ArrayType(ArrayType(StringType()))),
            StructField("ack", ArrayType(LongType())),
            StructField("removed", LongType()),
            StructField("members", ArrayType(StringType())),
            StructField("version", LongType()),
            StructField("peer", StringType()),
            StructField("mirror", StringType()),
        ]
    )


@dataclass
class Result:
    valid: bool
    counts: dict
    examples: dict
    latency: list  # [(bucket start, n, p50, p95, p99)]
    throughput: list  # [(second, confirms, node publishes)]
    events: list  # [(time, kind, what)]
    windows: list  # [(start, end, what)]
    seconds: float = 0.0
    inputs: dict = field(default_factory=dict)


def run(spark: Any, client_paths: list[str], node_paths: list[str], *, bucket: float | None = None) -> Result:
    """The audit as Spark jobs over the histories; small results come back to the driver."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    t0 = time.monotonic()
    empty = spark.createDataFrame([], client_schema())
    h = spark.read.schema(client_schema()).json(client_paths) if client_paths else empty
    h = h.cache()
    if bucket is None:  # about 100 buckets over the run, 0.05 s at the finest
        span = h.agg(F.min("time").alias("a"), F.max("time").alias("b")).collect()[0]
        bucket = max(0.05, ((span["b"] or 0) - (span["a"] or 0)) / 100) if span["a"] is not None else 1.0
    pub = h.filter(F.col("f") == "publish")
    inv = pub.filter(F.col("type") == "invoke").select("value", "publisher", "seq", F.col("time").alias("t_inv"))
    ok = pub.filter(F.col("type") == "ok").select("value", F.col("time").alias("t_ok"))
    info = pub.filter(F.col("type") == "info").select("value")
    con = h.filter((F.col("f") == "consume") & (F.col("type") == "ok"))
    consumed = con.groupBy("value").agg(
        F.count("*").alias("n"), F.sum(F.col("redelivered").cast("int")).alias("redelivered")
    )

    lost = ok.join(consumed, "value", "left_anti")
    unexpected = consumed.join(inv, "value", "left_anti")
    dups = consumed.filter(F.col("n") > 1)
    recovered = info.join(consumed, "value", "left_semi")
    w = Window.partitionBy("process", "publisher").orderBy("time")
    first = con.filter(~F.coalesce(F.col("redelivered"), F.lit(False))).filter(F.col("publisher").isNotNull())
    first = first.withColumn("prev_max", F.max("seq").over(w.rowsBetween(Window.unboundedPreceding, -1)))
    reordered = first.filter(F.col("seq") < F.col("prev_max"))

    counts = {
        "publish_invoked": inv.count(),
        "publish_ok": ok.count(),
        "publish_failed": pub.filter(F.col("type") == "fail").count(),
        "publish_info": info.count(),
        "consumed": con.count(),
        "consumed_distinct": consumed.count(),
        "lost": lost.count(),
        "unexpected": unexpected.count(),
        "duplicated": dups.count(),
        "recovered": recovered.count(),
        "reordered": reordered.count(),
    }
    examples = {
        "lost": [r["value"] for r in lost.limit(EXAMPLES).collect()],
        "unexpected": [r["value"] for r in unexpected.limit(EXAMPLES).collect()],
        "duplicated": [(r["value"], r["n"]) for r in dups.limit(EXAMPLES).collect()],
        "reordered": [
            (r["process"], r["publisher"], r["seq"], r["prev_max"]) for r in reordered.limit(EXAMPLES).collect()
        ],
    }
    lat = inv.join(ok, "value").select(
        (F.floor(F.col("t_ok") / bucket) * bucket).alias("b"), ((F.col("t_ok") - F.col("t_inv")) * 1000).alias("ms")
    )
    latency = [
        (r["b"], r["n"], r["p"][0], r["p"][1], r["p"][2])
        for r in lat.groupBy("b")
        .agg(F.count("*").alias("n"), F.percentile_approx("ms", [0.5, 0.95, 0.99], 1000).alias("p"))
        .orderBy("b")
        .collect()
    ]
    lat_all = lat.agg(F.percentile_approx("ms", [0.5, 0.95, 0.99, 1.0], 1000).alias("p")).collect()[0]["p"]
    counts["confirm_latency_ms"] = dict(zip(("p50", "p95", "p99", "max"), lat_all or [None] * 4))
    per = 1.0 / bucket
    tput = {
        r["s"]: [r["n"] * per, 0]
        for r in ok.groupBy((F.floor(F.col("t_ok") / bucket) * bucket).alias("s"))
        .count()
        .withColumnRenamed("count", "n")
        .collect()
    }
    counts["bucket_s"] = round(bucket, 3)
    events: list = [
        (r["time"], r["f"], r["value"])
        for r in h.filter(
            (F.col("type") == "info") & F.col("f").isin("kill", "start", "partition", "heal", "stop")
        ).collect()
    ]

    if node_paths:
        text = spark.read.text(node_paths)
        n = (
            text.select(F.from_json("value", node_schema()).alias("j"))
            .select("j.*")
            .filter(F.col("event").isNotNull())
            .cache()
        )
        hist = n.filter(F.col("event") == "history")
        np_ = hist.select(
            (F.floor(F.col("ts") / bucket) * bucket).alias("s"), F.size(F.coalesce("publish", F.array())).alias("k")
        )
        for r in np_.groupBy("s").agg(F.sum("k").alias("k")).collect():
            tput.setdefault(r["s"], [0, 0])[1] = r["k"] * per
        node_pubs = hist.select("queue", F.explode("publish").alias("p")).select(
            "queue",
            F.col("p")[3].alias("ref"),
            F.col("p")[4].alias("ref_seq"),
            F.col("p")[1].alias("publisher"),
            F.col("p")[2].alias("seq"),
        )
        counts["node_publishes"] = node_pubs.count()
        dup_refs = (
            node_pubs.filter(F.col("ref").isNotNull()).groupBy("queue", "ref", "ref_seq").count().filter("count > 1")
        )
        counts["node_duplicate_ref_publishes"] = dup_refs.count()
        counts["node_confirm_lines"] = n.filter(F.col("event") == "history_confirm").count()
        counts["node_nacks"] = n.filter(F.col("event") == "history_nack").select(F.explode("nack")).count()
        counts["stream_commits"] = n.filter(F.col("event") == "stream_commit").count()
        for r in (
            n.filter(F.col("event").isin("promoted", "node_down", "node_up", "sync_started", "mirror_synchronised"))
            .select("ts", "event", "node", "queue", "member", "peer", "mirror")
            .collect()
        ):
            what = r["queue"] or r["peer"] or r["node"]
            if r["event"] == "promoted":
                what = f"{r['queue']} -> {r['member']}"
            events.append((r["ts"], r["event"], what))
        counts["view_changes"] = n.filter(F.col("event") == "view_change").count()
    events.sort(key=lambda e: e[0])
    windows = _failover_windows(events)
    counts["failovers"] = len(windows)
    throughput = sorted((s, v[0], v[1]) for s, v in tput.items())
    valid = counts["lost"] == 0 and counts["unexpected"] == 0
    h.unpersist()
    return Result(
        valid,
        counts,
        examples,
        latency,
        throughput,
        events,
        windows,
        time.monotonic() - t0,
        {"client": client_paths, "nodes": node_paths},
    )


def _failover_windows(events: list) -> list:
    """From a kill (client nemesis or a node_down) to the next promotion."""
    out = []
    start = None
    for t, kind, what in events:
        if kind in ("kill", "node_down") and start is None:
            start = (t, f"{kind} {what}")
        elif kind == "promoted" and start is not None:
            out.append((start[0], t, f"{start[1]} .. promoted {what}"))
            start = None
    return out


# ---- outputs -------------------------------------------------------------------------------------
def report(res: Result, path: str, png: str | None = None) -> str:
    c = res.counts
    t0 = res.throughput[0][0] if res.throughput else 0
    lines = [
        "# mirrorq audit",
        "",
        f"**Verdict: {'VALID' if res.valid else 'INVALID'}** (lost {c['lost']}, unexpected {c['unexpected']}; "
        f"duplicated {c['duplicated']}, reordered {c['reordered']} are reported, not failures)",
        "",
        f"Inputs: {len(res.inputs.get('client', []))} client history file(s), "
        f"{len(res.inputs.get('nodes', []))} node log(s); "
        f"audit took {res.seconds:.1f} s.",
        "",
        "| check | count |",
        "|---|---|",
    ]
    for k, v in c.items():
        if k != "confirm_latency_ms":
            lines.append(f"| {k} | {v} |")
    lat = c.get("confirm_latency_ms") or {}
    lines += [
        "",
        "## Confirm latency (ms)",
        "",
        "overall: " + ", ".join(f"{k} {v:.1f}" for k, v in lat.items() if v is not None),
        "",
        "| t (s) | confirms | p50 | p95 | p99 |",
        "|---|---|---|---|---|",
    ]
    step = max(1, len(res.latency) // 40)
    for b, n, p50, p95, p99 in res.latency[::step]:
        lines.append(f"| {b - t0:.2f} | {n} | {p50:.1f} | {p95:.1f} | {p99:.1f} |")
    lines += ["", "## Failover windows", ""]
    lines += [f"- {a - t0:.2f} s .. {b - t0:.2f} s ({b - a:.2f} s): {what}" for a, b, what in res.windows] or ["- none"]
    lines += ["", "## Examples", ""]
    for k, v in res.examples.items():
        if v:
            lines.append(f"- {k}: {v}")
    lines += ["", "## Events", ""]
    lines += [f"- {t - t0:.2f} s {kind} {what}" for t, kind, what in res.events[:200]] or ["- none"]
    if png:
        lines += ["", f"![timeline]({os.path.basename(png)})"]
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


def timeline(res: Result, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = res.throughput[0][0] if res.throughput else (res.latency[0][0] if res.latency else 0)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    if res.throughput:
        xs = [s - t0 for s, _, _ in res.throughput]
        a1.plot(xs, [c for _, c, _ in res.throughput], ".-", label="client confirms/s", color="tab:blue")
        a1.plot(
            xs,
            [n for _, _, n in res.throughput],
            ".-",
            label="master publishes/s (node logs)",
            color="tab:green",
            alpha=0.7,
        )
    a1.set_ylabel("messages/s")
    if res.latency:
        xs = [b - t0 for b, *_ in res.latency]
        a2.plot(xs, [p[2] for p in res.latency], ".-", label="p50", color="tab:blue")
        a2.plot(xs, [p[4] for p in res.latency], ".-", label="p99", color="tab:red")
        a2.set_yscale("log")
    a2.set_ylabel("confirm latency (ms)")
    a2.set_xlabel("seconds")
    for ax in (a1, a2):
        for a, b, _ in res.windows:
            ax.axvspan(a - t0, b - t0, color="orange", alpha=0.25)
        for t, kind, _ in res.events:
            if kind in ("kill", "node_down"):
                ax.axvline(t - t0, color="red", linestyle="--", linewidth=1)
            elif kind == "promoted":
                ax.axvline(t - t0, color="purple", linestyle=":", linewidth=1)
        ax.legend(loc="upper right", fontsize=8)
    a1.set_title(
        f"mirrorq audit: {'VALID' if res.valid else 'INVALID'} -- "
        "red: kills, purple: promotions, orange: failover windows"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- synthetic histories (tests, bench) ---------------------------------------------------------------
def synthesize(
    path: str, events: int, *, publishers: int = 8, seed: int = 1, plant: tuple = (), start: float = 1.7e9
) -> dict:
    """A well-formed history of about ``events`` lines (publish invoke/ok,
    consume ok), optionally with planted anomalies: ``"lost"`` (a confirmed
    publish never consumed), ``"duplicate"`` (one message consumed twice),
    ``"reorder"`` (two first deliveries of one publisher swapped),
    ``"unexpected"``.  Returns what was planted (values)."""
    rng = random.Random(seed)
    per_msg = 3
    n = max(1, events // per_msg)
    planted: dict = {}
    t = start
    seqs = [0] * publishers
    order = []
    with open(path, "w") as f:

        def w(
            kind: str, op: str, process: str, publisher: str, seq: int, value: str, at: float, extra: str = ""
        ) -> None:
            f.write(
                f'{{"type":"{kind}","f":"{op}","process":"{process}","publisher":"{publisher}","seq":{seq},'
                f'"value":"{value}","time":{at:.6f}{extra}}}\n'
            )

        for i in range(n):
            p = i % publishers
            seqs[p] += 1
            v = f"p{p}-{seqs[p]}"
            t += rng.uniform(0.00005, 0.0002)
            w("invoke", "publish", f"c{p}", f"p{p}", seqs[p], v, t)
            w("ok", "publish", f"c{p}", f"p{p}", seqs[p], v, t + rng.uniform(0.001, 0.02))
            order.append((p, seqs[p], v))
        if "lost" in plant:
            planted["lost"] = order[n // 2][2]
        if "reorder" in plant:
            a = next(k for k in range(n // 3, n) if order[k][0] == 1)
            b = next(k for k in range(a + 1, n) if order[k][0] == 1)
            order[a], order[b] = order[b], order[a]
            planted["reorder"] = (order[b][2], order[a][2])
        for p, s, v in order:
            if planted.get("lost") == v:
                continue
            t += rng.uniform(0.00005, 0.0002)
            w("ok", "consume", "consumer", f"p{p}", s, v, t, ',"redelivered":false')
        if "duplicate" in plant:
            p, s, v = order[n // 4]
            w("ok", "consume", "consumer", f"p{p}", s, v, t + 0.01, ',"redelivered":true')
            planted["duplicate"] = v
        if "unexpected" in plant:
            w("ok", "consume", "consumer", "px", 1, "ghost", t + 0.02)
            planted["unexpected"] = "ghost"
    return planted


# ---- mirrorctl audit ------------------------------------------------------------------------------------
def node_logs(data_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(data_dir, "*", "node.log")))


def main(data_dir: str | None, histories: list[str], out: str, master: str = "local[*]") -> int:
    from mirrorq.spark.session import session

    nodes = node_logs(data_dir) if data_dir else []
    if not nodes and not histories:
        print("mirrorctl audit: no node logs under the data dir and no --history files: nothing to audit")
        return 2
    os.makedirs(out, exist_ok=True)
    from pyspark.sql import SparkSession

    mine = SparkSession.getActiveSession() is None  # a caller's session (tests) is left running
    spark = session("mirrorq-audit", master=master)
    try:
        res = run(spark, histories, nodes)
    finally:
        if mine:
            spark.stop()
    png = os.path.join(out, "timeline.png")
    timeline(res, png)
    report(res, os.path.join(out, "report.md"), png)
    print(
        json.dumps(
            {
                "valid": res.valid,
                "report": os.path.join(out, "report.md"),
                "timeline": png,
                **{k: v for k, v in res.counts.items() if k != "confirm_latency_ms"},
            }
        )
    )
    return 0 if res.valid else 1
