"""pipe: a streaming query from a mirrored queue into parquet (a driver you can kill).

``python -m mirrorq.spark.pipe --nodes H:P[,H:P] (--queue Q[,Q...] | --queue-pattern RE)
--checkpoint DIR --output DIR [--master URL] [--conf K=V]... [--max-per-trigger N] [--min-partitions N]
[--until-empty] [--idle S]``

Runs ``readStream.format("mirrorq") -> writeStream.parquet`` with the
checkpoint.  Killed at any moment and started again with the same
checkpoint, the parquet output ends with each message exactly once (Spark's
file sink commits each batch once; the source replays the uncommitted
range identically).  With ``--until-empty`` it stops once the queue holds
nothing beyond what the query processed and no batch is running, then
commits the last batch (:func:`commit_checkpoint`: Spark itself commits a
batch's source range only when it plans the next batch, i.e. on the next
start), so the queue ends empty.  It prints one JSON line per event
(``started``, ``progress``, ``stopped``) on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _options(args: argparse.Namespace) -> dict:
    opts = {"nodes": args.nodes, "startingOffsets": "earliest", "messagesPerPartition": str(args.per_partition)}
    if args.queue_pattern:
        opts["queuePattern"] = args.queue_pattern
    else:
        opts["queues"] = args.queue
    if args.max_per_trigger:
        opts["maxMessagesPerTrigger"] = str(args.max_per_trigger)
    if args.min_partitions:
        opts["minPartitions"] = str(args.min_partitions)
    return opts


def checkpoint_last_committed(checkpoint: str) -> tuple[int, dict] | None:
    """(batch id, the source's end offset) of the last batch in the
    checkpoint's commit log (its sink is done), or None."""
    commits = os.path.join(checkpoint, "commits")
    if not os.path.isdir(commits):
        return None
    ids = sorted(int(n) for n in os.listdir(commits) if n.isdigit())
    if not ids:
        return None
    batch = ids[-1]
    with open(os.path.join(checkpoint, "offsets", str(batch))) as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    return batch, json.loads(lines[2])  # v1, metadata, then one line per source


def commit_checkpoint(checkpoint: str, options: dict) -> dict | None:
    """Commit (remove from the queues) everything the checkpoint's last
    committed batch read: what Spark would do when planning the next batch."""
    from mirrorq.spark.source import _subscription, offsets_of

    last = checkpoint_last_committed(checkpoint)
    if last is None:
        return None
    sub = _subscription(options)
    out = {}
    for q, off in sorted(offsets_of(last[1], sub).items()):
        h = sub.conn_for(q).handle()
        try:
            out[q] = h.commit(off)
        finally:
            h.close()
    return out


def _all_read(checkpoint: str, options: dict) -> bool:
    """Whether the query's queues hold nothing beyond what its last committed batch read."""
    from mirrorq.spark.source import _call, _subscription, offsets_of

    last = checkpoint_last_committed(checkpoint)
    if last is None:
        return False
    sub = _subscription(options)
    done = offsets_of(last[1], sub)
    return not any(_call(sub.conn_for(q), lambda h, q=q: h.bounds(done.get(q, 0), 1))["count"] for q in sub.current())


def _say(**fields: Any) -> None:
    print(json.dumps(fields, default=str), flush=True)


def run(args: argparse.Namespace) -> int:
    from mirrorq.spark.session import session

    conf = dict(kv.split("=", 1) for kv in args.conf)
    spark = session("mirrorq-pipe", master=args.master, conf=conf)
    opts = _options(args)
    df = spark.readStream.format("mirrorq").options(**opts).load()
    q = (
        df.select("offset", "body", "redelivered")
        .writeStream.format("parquet")
        .option("path", args.output)
        .option("checkpointLocation", args.checkpoint)
        .start()
    )
    _say(event="started", pid=os.getpid(), id=str(q.id))
    idle_since = None
    said = None
    try:
        while q.isActive:
            time.sleep(0.5)
            p = q.lastProgress
            if p and p.get("batchId") != said:
                said = p.get("batchId")
                _say(
                    event="progress",
                    batch=p.get("batchId"),
                    rows=p.get("numInputRows"),
                    rate=p.get("processedRowsPerSecond"),
                    ms=p.get("durationMs"),
                )
            if not args.until_empty:
                continue
            if not q.status.get("isTriggerActive") and _all_read(args.checkpoint, opts):
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= args.idle:
                    break
            else:
                idle_since = None
        if q.exception():
            raise q.exception()
    finally:
        q.stop()
    res = commit_checkpoint(args.checkpoint, opts)
    _say(event="stopped", committed=res)
    spark.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mirrorq.spark.pipe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", required=True)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--queue", help="a queue, or several separated by commas")
    which.add_argument("--queue-pattern", help="every queue whose name this regular expression matches whole")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--master", default="local[2]", help="Spark master: local[N], spark://HOST:PORT...")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="a Spark setting (repeatable)")
    ap.add_argument("--max-per-trigger", type=int, default=0)
    ap.add_argument("--per-partition", type=int, default=10000)
    ap.add_argument("--min-partitions", type=int, default=0)
    ap.add_argument("--until-empty", action="store_true")
    ap.add_argument("--idle", type=float, default=1.5, help="s with nothing new before --until-empty stops")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
