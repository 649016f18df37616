"""The mirrorq data source and sink on a real 3-node cluster (ha-mode all).

* 50k persistent messages -> streaming query into parquet with a
  checkpoint; the driver is SIGKILLed mid-stream and restarted from the
  checkpoint: the parquet holds each message exactly once (no
  de-duplication in the query) and the queue ends empty.
* kill -9 of the master's node during a streaming query: nothing lost,
  nothing duplicated in the sink.
* a stream sink whose task fails after publishing part of its rows is
  retried: the queue holds each row once (publisher refs).
* the range reader is the queue's only consumer: a pika consumer beside it
  is refused, naming the conflict; bad ranges are refused, naming them.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import conftest
import pytest
from spark_support import (  # noqa: F401  (cluster, spark: fixtures)
    cluster,
    committed_batches,
    declare,
    driver,
    kill_group,
    nodes_of,
    publish,
    queue_info,
    spark,
    wait_exit,
    wait_mirrored,
)

pytestmark = [pytest.mark.cluster, pytest.mark.spark]


def _workdir() -> Path:
    return Path(tempfile.mkdtemp(dir=conftest._ROOT, prefix="spark-"))


def _read_sink(spark, output: Path):
    """The file sink's committed output (Spark reads _spark_metadata: files of
    a batch the killed driver never committed are not part of it)."""
    rows = spark.read.parquet(str(output)).select("offset", "body").collect()
    return [r["offset"] for r in rows], [bytes(r["body"]) for r in rows]


def test_driver_killed_mid_stream_replays_exactly_once(cluster, spark, capsys):
    q, n = "spark.fifty", 50_000
    declare(cluster, q)
    bodies = publish(cluster, q, n, size=100)
    wait_mirrored(cluster, capsys, q, n)
    w = _workdir()
    ck, out, log = w / "ck", w / "out", w / "driver.log"
    args = (
        "--nodes",
        nodes_of(cluster),
        "--queue",
        q,
        "--checkpoint",
        str(ck),
        "--output",
        str(out),
        "--max-per-trigger",
        "4000",
    )
    with driver(*args, log=log) as p:
        conftest.wait_for(
            lambda: (committed_batches(ck) >= 3, committed_batches(ck)),
            180,
            "three committed batches before the kill",
            lambda: log.read_text()[-3000:],
        )
        kill_group(p)  # SIGKILL mid-stream: a batch is usually running
    killed_at = committed_batches(ck)
    assert killed_at < n // 4000, "the query had finished before the kill: nothing was tested"
    left = queue_info(cluster, capsys, q)["messages"]
    assert 0 < left < n, f"after the kill the queue holds {left} messages"
    with driver(*args, "--until-empty", log=log) as p:
        assert wait_exit(p, 300, log) == 0, log.read_text()[-3000:]
    offsets, got = _read_sink(spark, out)
    assert len(got) == n, f"parquet holds {len(got)} rows for {n} messages (duplicates: {len(got) - len(set(got))})"
    assert sorted(got) == sorted(bodies)
    assert len(set(offsets)) == n
    conftest.wait_for(
        lambda: (queue_info(cluster, capsys, q)["messages"] == 0, queue_info(cluster, capsys, q)),
        30,
        "the queue to end empty",
    )


def test_master_killed_mid_stream(cluster, spark, capsys):
    q, n = "spark.failover", 12_000
    declare(cluster, q, node=1)
    bodies = publish(cluster, q, n, size=100, node=1)
    wait_mirrored(cluster, capsys, q, n)
    master_node = queue_info(cluster, capsys, q)["pid"].split("/")[0]
    w = _workdir()
    ck, out, log = w / "ck", w / "out", w / "driver.log"
    args = (
        "--nodes",
        nodes_of(cluster),
        "--queue",
        q,
        "--checkpoint",
        str(ck),
        "--output",
        str(out),
        "--max-per-trigger",
        "1500",
        "--until-empty",
    )
    with driver(*args, log=log) as p:
        conftest.wait_for(
            lambda: (committed_batches(ck) >= 1, committed_batches(ck)),
            180,
            "a committed batch before the kill",
            lambda: log.read_text()[-3000:],
        )
        assert p.poll() is None and committed_batches(ck) < n // 1500, "the query ended before the kill"
        assert cluster.ctl("kill_node", master_node) == 0
        assert wait_exit(p, 300, log) == 0, log.read_text()[-3000:]
    offsets, got = _read_sink(spark, out)
    assert sorted(got) == sorted(bodies), f"sink holds {len(got)} rows, {len(set(got))} distinct, for {n} messages"
    new_master = queue_info(cluster, capsys, q)
    assert not new_master["pid"].startswith(master_node + "/")
    assert new_master["messages"] == 0
    assert cluster.ctl("start_node", master_node) == 0  # the module's later tests get three nodes back


def test_sink_task_retry_publishes_each_row_once(cluster, spark, capsys, tmp_path):
    """Queue A -> (a UDF that fails the first attempt of the task after the
    sink published its first 2000 rows) -> sink into queue B."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType

    src, dst, n = "spark.sink-in", "spark.sink-out", 5000
    declare(cluster, src)
    declare(cluster, dst)
    bodies = publish(cluster, src, n, size=40)
    marker = Path(tempfile.mkdtemp(dir=conftest._ROOT)) / "failed-once"

    def fail_first_attempt(offset, body):
        from pyspark import TaskContext

        if TaskContext.get().attemptNumber() == 0 and offset >= 3500:
            marker.write_text("failed")
            raise RuntimeError("forced failure of the task's first attempt")
        return body

    udf = F.udf(fail_first_attempt, BinaryType(), useArrow=False)
    opts = {"nodes": nodes_of(cluster), "queue": src, "maxMessagesPerTrigger": str(n)}
    df = spark.readStream.format("mirrorq").options(**opts).load().select(udf("offset", "body").alias("body"))
    query = (
        df.writeStream.format("mirrorq")
        .option("nodes", nodes_of(cluster))
        .option("queue", dst)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        query.awaitTermination(240)
    finally:
        query.stop()
    assert marker.exists(), "the forced task failure did not happen: nothing was replayed"
    assert query.exception() is None
    conftest.wait_for(
        lambda: (queue_info(cluster, capsys, dst)["messages"] == n, queue_info(cluster, capsys, dst)),
        30,
        f"{n} rows in the sink's queue",
    )
    from mirrorq.spark.broker import QueueHandle

    h = QueueHandle(nodes_of(cluster), dst)
    try:
        b = h.bounds()
        got = [d.body for d in h.read(b["first_offset"], b["next_offset"])]
    finally:
        h.close()
    assert sorted(got) == sorted(bodies), f"{len(got)} rows, {len(set(got))} distinct"


def test_range_reader_is_the_only_consumer(cluster, capsys):
    import pika

    from mirrorq.spark.broker import QueueError, QueueHandle

    q = "spark.conflict"
    declare(cluster, q)
    publish(cluster, q, 10, size=10)
    h = QueueHandle(nodes_of(cluster), q, timeout=10)
    try:
        b = h.bounds()
        assert len(list(h.read(b["first_offset"], b["next_offset"]))) == 10
        conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", cluster.amqp_base_port + 2))
        try:
            ch = conn.channel()
            with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="range reader"):
                ch.basic_consume(q, lambda *a: None)
        finally:
            conn.close()
        with pytest.raises(QueueError, match="beyond the end of its log"):
            list(h.read(0, b["next_offset"] + 100))
        with pytest.raises(QueueError, match="beyond the end of its log"):
            h.commit(b["next_offset"] + 100)
        # pika speaks the extension too: a range read with x-stream-offset
        conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", cluster.amqp_base_port))
        try:
            ch = conn.channel()
            seen = []
            ch.basic_consume(
                q,
                lambda c, m, p, body: seen.append(p.headers["x-stream-offset"]),
                auto_ack=True,
                arguments={"x-stream-offset": b["first_offset"], "x-stream-end-offset": b["next_offset"]},
            )
            deadline = time.monotonic() + 10
            while len(seen) < 10 and time.monotonic() < deadline:
                conn.process_data_events(0.1)
            assert seen == sorted(seen) and len(seen) == 10
        finally:
            conn.close()
        assert h.commit(b["next_offset"])["removed"] == 10
    finally:
        h.close()


def test_audit_of_a_real_kill_test_history_is_clean(cluster, spark, capsys, tmp_path):
    """A publisher writes a client history (invoke/ok/info) while the
    master's node is killed; a range reader drains the queue writing
    consume oks; mirrorctl audit over that history and the nodes' logs
    reports no loss, nothing unexpected and the failover."""
    import json as _json

    from pamqp import commands as C

    from mirrorq.amqp.client import AmqpError, BlockingClient
    from mirrorq.spark import audit
    from mirrorq.spark.broker import QueueHandle, offset_of

    q = "spark.audit"
    declare(cluster, q, node=2)
    wait_mirrored(cluster, capsys, q, 0)
    master_node = queue_info(cluster, capsys, q)["pid"].split("/")[0]
    others = [i for i in range(cluster.nodes) if f"node{i + 1}" != master_node]
    hist = tmp_path / "client.jsonl"
    f = open(hist, "w")

    def say(**kw):
        f.write(_json.dumps(kw) + "\n")

    seq, killed = 0, False
    node = others[0]
    cl = BlockingClient("127.0.0.1", cluster.amqp_base_port + node)
    try:
        for batch in range(30):
            if batch == 10:
                say(type="info", f="kill", value=master_node, time=time.time())
                assert cluster.ctl("kill_node", master_node) == 0
                killed = True
            msgs, vals = [], []
            for _ in range(100):
                seq += 1
                v = f"a-{seq}"
                vals.append((seq, v))
                say(type="invoke", f="publish", process="p0", publisher="p0", seq=seq, value=v, time=time.time())
                msgs.append(
                    (
                        v.encode(),
                        C.Basic.Properties(
                            delivery_mode=2, headers={"x-publisher-ref": "audit-p0", "x-publishing-id": seq, "seq": seq}
                        ),
                    )
                )
            for attempt in range(30):
                try:
                    cl.publish_confirmed("", q, msgs, time.monotonic() + 10)
                    break
                except AmqpError:
                    cl.close()  # outcome unknown: resend the batch (the publisher ref drops what is in)
                    time.sleep(0.3)
                    cl = BlockingClient("127.0.0.1", cluster.amqp_base_port + others[(attempt + 1) % len(others)])
            else:
                raise AssertionError("publishes not confirmed after the failover")
            now = time.time()
            for s, v in vals:
                say(type="ok", f="publish", process="p0", publisher="p0", seq=s, value=v, time=now)
    finally:
        cl.close()
    assert killed
    h = QueueHandle(nodes_of(cluster), q)
    try:
        b = h.bounds()
        for d in h.read(b["first_offset"], b["next_offset"]):
            hd = d.properties.headers
            say(
                type="ok",
                f="consume",
                process="reader",
                publisher="p0",
                seq=hd["seq"],
                value=d.body.decode(),
                time=time.time(),
                redelivered=d.redelivered,
            )
            last = offset_of(d)
        h.commit(last + 1)
    finally:
        h.close()
    f.close()
    res = audit.run(spark, [str(hist)], audit.node_logs(str(cluster.data_dir)))
    c = res.counts
    assert res.valid, (c, res.examples)
    assert c["publish_ok"] == c["consumed_distinct"] == 3000 and c["duplicated"] == 0 and c["reordered"] == 0, c
    assert c["node_publishes"] >= 3000 and c["node_duplicate_ref_publishes"] == 0, c
    assert res.windows, f"no failover window found in {res.events[:20]}"
    out = tmp_path / "audit"
    out.mkdir()
    audit.timeline(res, str(out / "timeline.png"))
    audit.report(res, str(out / "report.md"), str(out / "timeline.png"))
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG" and "VALID" in (out / "report.md").read_text()
    assert cluster.ctl("start_node", master_node) == 0
    if os.environ.get("MIRRORQ_KEEP_AUDIT"):  # to look at the report and the picture
        import shutil

        shutil.copytree(out, os.environ["MIRRORQ_KEEP_AUDIT"], dirs_exist_ok=True)


def test_many_queues_by_pattern_in_partitions(cluster, spark, capsys, tmp_path):
    """queuePattern: one query reads every matching queue (masters on
    different nodes), splits each queue's range into partitions
    (minPartitions), picks up a queue declared while it runs, leaves other
    queues alone, and writes each message to parquet once."""
    from mirrorq.spark.source import MirrorqStreamReader, offsets_of

    pattern = r"spark\.multi\..*"
    declare(cluster, "spark.multi.a", node=0)
    declare(cluster, "spark.multi.b", node=1)
    declare(cluster, "spark.other", node=2)
    bodies = publish(cluster, "spark.multi.a", 3000, size=40, prefix="a")
    bodies += publish(cluster, "spark.multi.b", 3000, size=40, node=1, prefix="b")
    publish(cluster, "spark.other", 10, size=10, prefix="o")

    r = MirrorqStreamReader({"nodes": nodes_of(cluster), "queuePattern": pattern, "minPartitions": "6"})
    start = r.initialOffset()
    assert set(offsets_of(start)) == {"spark.multi.a", "spark.multi.b"}
    parts = r.partitions(start, r.latestOffset(start, None))
    assert len(parts) >= 6, parts
    for q in ("spark.multi.a", "spark.multi.b"):
        mine = sorted((p for p in parts if p.conn.queue == q), key=lambda p: p.start)
        assert len(mine) >= 3 and sum(p.count for p in mine) == 3000
        assert all(a.end == b.start for a, b in zip(mine, mine[1:], strict=False)), "ranges must be contiguous"

    out, ck = tmp_path / "out", tmp_path / "ck"
    opts = {
        "nodes": nodes_of(cluster),
        "queuePattern": pattern,
        "minPartitions": "4",
        "maxMessagesPerTrigger": "2000",
    }
    query = (
        spark.readStream.format("mirrorq")
        .options(**opts)
        .load()
        .select("offset", "body")
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(ck))
        .trigger(processingTime="0.5 seconds")
        .start()
    )
    try:
        conftest.wait_for(
            lambda: (committed_batches(ck) >= 1, committed_batches(ck)), 120, "a first batch", query.exception
        )
        declare(cluster, "spark.multi.c", node=2)
        bodies += publish(cluster, "spark.multi.c", 1500, size=40, node=2, prefix="c")

        def rows():
            n = spark.read.parquet(str(out)).count() if (out / "_spark_metadata").is_dir() else 0
            return n >= len(bodies), n

        conftest.wait_for(rows, 180, f"{len(bodies)} rows in parquet", query.exception)
    finally:
        query.stop()
    assert query.exception() is None
    _offsets, got = _read_sink(spark, out)
    assert len(got) == len(bodies) and sorted(got) == sorted(bodies), f"{len(got)} rows, {len(set(got))} distinct"
    assert queue_info(cluster, capsys, "spark.other")["messages"] == 10
    assert queue_info(cluster, capsys, "spark.multi.a")["messages"] < 3000  # committed batches were removed


def test_standalone_cluster_runs_the_query_and_the_audit(cluster, spark, capsys, tmp_path):
    """A Spark standalone cluster on loopback (a master, two workers): the
    queue -> parquet query (two queues, two partitions each) and
    ``mirrorctl audit --master spark://...`` run on it unchanged."""
    import json as _json
    import subprocess
    import sys

    from spark_support import REPO, standalone

    qs, n = ["spark.sa.a", "spark.sa.b"], 3000
    bodies = []
    for i, q in enumerate(qs):
        declare(cluster, q, node=i)
        bodies += publish(cluster, q, n, size=40, node=i, prefix=q[-1])
    ck, out, log = tmp_path / "ck", tmp_path / "out", tmp_path / "driver.log"
    with standalone(tmp_path / "spark") as (url, conf):
        args = [
            "--nodes",
            nodes_of(cluster),
            "--queue",
            ",".join(qs),
            "--checkpoint",
            str(ck),
            "--output",
            str(out),
            "--max-per-trigger",
            "2000",
            "--min-partitions",
            "4",
            "--until-empty",
            "--master",
            url,
        ]
        args += [f"--conf={k}={v}" for k, v in conf.items()]
        with driver(*args, log=log) as p:
            assert wait_exit(p, 300, log) == 0, log.read_text()[-3000:]
        assert "app-" in "".join(f.name for f in (tmp_path / "spark" / "work").iterdir()), (
            "no application ran on the workers"
        )
        audit = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from ctl.mirrorctl import main; sys.exit(main(sys.argv[1:]))",
                "--data-dir",
                str(cluster.data_dir),
                "audit",
                "--master",
                url,
                "--out",
                str(tmp_path / "audit"),
            ],
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            capture_output=True,
            text=True,
            timeout=300,
        )
    lines = [ln for ln in audit.stdout.splitlines() if ln.startswith("{")]
    assert lines, audit.stdout[-2000:] + audit.stderr[-3000:]
    res = _json.loads(lines[-1])
    assert res["node_publishes"] >= 2 * n and (tmp_path / "audit" / "report.md").exists(), res
    _offsets, got = _read_sink(spark, out)
    assert sorted(got) == sorted(bodies), f"{len(got)} rows, {len(set(got))} distinct"
    for q in qs:
        assert queue_info(cluster, capsys, q)["messages"] == 0


def test_many_queues_survive_a_driver_kill_and_a_master_kill(cluster, spark, capsys):
    """Two queues (masters on different nodes), four partitions a batch:
    the driver is SIGKILLed mid-stream and restarted from its checkpoint,
    then the master of one queue is killed while the restarted query runs;
    the parquet output holds every message exactly once and both queues
    end empty."""
    qs, n = ["spark.faults.a", "spark.faults.b"], 5000
    bodies = []
    for i, q in enumerate(qs):
        declare(cluster, q, node=i)
        bodies += publish(cluster, q, n, size=60, node=i, prefix=q[-1])
    for q in qs:
        wait_mirrored(cluster, capsys, q, n)
    victim = queue_info(cluster, capsys, qs[1])["pid"].split("/")[0]
    w = _workdir()
    ck, out, log = w / "ck", w / "out", w / "driver.log"
    args = ("--nodes", nodes_of(cluster), "--queue", ",".join(qs), "--checkpoint", str(ck), "--output", str(out),
            "--max-per-trigger", "1500", "--min-partitions", "4")  # fmt: skip
    with driver(*args, log=log) as p:
        conftest.wait_for(
            lambda: (committed_batches(ck) >= 2, committed_batches(ck)),
            180,
            "two committed batches before the driver's kill",
            lambda: log.read_text()[-3000:],
        )
        kill_group(p)
    killed_at = committed_batches(ck)
    assert killed_at < 2 * n // 1500, "the query had finished before the kill: nothing was tested"
    with driver(*args, "--until-empty", log=log) as p:
        conftest.wait_for(
            lambda: (committed_batches(ck) >= killed_at + 1, committed_batches(ck)),
            180,
            "a committed batch after the restart",
            lambda: log.read_text()[-3000:],
        )
        assert p.poll() is None and committed_batches(ck) < 2 * n // 1500, "the query ended before the master's kill"
        assert cluster.ctl("kill_node", victim) == 0
        assert wait_exit(p, 300, log) == 0, log.read_text()[-3000:]
    _offsets, got = _read_sink(spark, out)
    assert len(got) == len(bodies), f"parquet holds {len(got)} rows for {len(bodies)} messages"
    assert sorted(got) == sorted(bodies)
    for q in qs:
        assert queue_info(cluster, capsys, q)["messages"] == 0
    assert cluster.ctl("start_node", victim) == 0  # the module's later tests get three nodes back
