"""pipe: a streaming query from a mirrored queue into parquet (a driver you can kill).

``python -m mirrorq.spark.pipe --nodes H:P[,H:P] --queue Q --checkpoint DIR --output DIR
[--max-per-trigger N] [--until-empty] [--idle S]``

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
    """Commit (remove from the queue) everything the checkpoint's last
    committed batch read: what Spark would do when planning the next batch."""
    from mirrorq.spark.source import _conn

    last = checkpoint_last_committed(checkpoint)
    if last is None:
        return None
    h = _conn(options).handle()
    try:
        return h.commit(int(last[1]["offset"]))
    finally:
        h.close()


def _say(**fields: Any) -> None:
    print(json.dumps(fields, default=str), flush=True)


def run(args: argparse.Namespace) -> int:
    from mirrorq.spark.session import session
    from mirrorq.spark.source import _conn

    spark = session("mirrorq-pipe", master=args.master)
    opts = {
        "nodes": args.nodes,
        "queue": args.queue,
        "startingOffsets": "earliest",
        "messagesPerPartition": str(args.per_partition),
    }
    if args.max_per_trigger:
        opts["maxMessagesPerTrigger"] = str(args.max_per_trigger)
    df = spark.readStream.format("mirrorq").options(**opts).load()
    q = (
        df.select("offset", "body", "redelivered")
        .writeStream.format("parquet")
        .option("path", args.output)
        .option("checkpointLocation", args.checkpoint)
        .start()
    )
    _say(event="started", pid=os.getpid(), id=str(q.id))
    h = _conn(opts).handle()
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
            last = checkpoint_last_committed(args.checkpoint)
            done_to = int(last[1]["offset"]) if last else None
            b = h.bounds(done_to, 1) if done_to is not None else h.bounds()
            if done_to is not None and b["count"] == 0 and not q.status.get("isTriggerActive"):
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= args.idle:
                    break
            else:
                idle_since = None
        if q.exception():
            raise q.exception()
    finally:
        h.close()
        q.stop()
    res = commit_checkpoint(args.checkpoint, opts)
    _say(event="stopped", committed=res)
    spark.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mirrorq.spark.pipe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", required=True)
    ap.add_argument("--queue", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--max-per-trigger", type=int, default=0)
    ap.add_argument("--per-partition", type=int, default=10000)
    ap.add_argument("--until-empty", action="store_true")
    ap.add_argument("--idle", type=float, default=1.5, help="s with nothing new before --until-empty stops")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
