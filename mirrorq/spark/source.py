"""The ``mirrorq`` PySpark data source: stream and batch reads of mirrored queues, stream and batch writes.

Reading (``spark.readStream.format("mirrorq")``)
------------------------------------------------
A query reads one queue (``queue``), several (``queues``, comma-separated)
or every classic queue of the vhost whose name a regular expression
matches whole (``queuePattern``; listed by the node at every planning
call, so queues declared later are read from their first message, and
queues deleted are dropped) -- Kafka's ``assign`` / ``subscribe`` /
``subscribePattern``.  Offsets are the queue logs' offsets (a message's
PUBLISH record offset), which name the same message on the master and
on every mirror, including after sync and after a promotion
(:mod:`mirrorq.amqp.stream`).  Spark's offset for this source is
``{"queues": {"<queue>": N, ...}}``: in each queue everything below N is
done (a checkpoint of the one-queue source, ``{"offset": N}``, is read as
its queue's).

* ``latestOffset(start, limit)`` asks each queue's master where a range
  from its start offset ends, at most ``limit`` (``maxMessagesPerTrigger``)
  live messages in all, shared among the queues by backlog as Kafka
  shares ``maxOffsetsPerTrigger``; nothing new anywhere: it returns
  ``start`` (no empty batches).  Spark writes the ranges to its
  checkpoint's offset log before the batch runs, so a batch is a *fixed*
  range ``[start, end)`` per queue.
* ``partitions(start, end)`` splits each queue's range into partitions of
  at most ``messagesPerPartition`` live messages, and into more where
  needed for about ``minPartitions`` in the batch (each queue its share by
  messages).  Each partition is read by its own task.
* ``read(partition)`` reads its sub-range WITHOUT removing anything (a
  range read), so a range read again -- a task retry, a restarted driver
  replaying the uncommitted batch from its checkpoint, a read resumed on
  a new master after a failover -- yields the same messages at the same
  offsets, in offset order.  It yields one Arrow record batch per
  range-read call (at most 20000 messages or about 4 MiB of bodies).
* ``commit(end)`` (called by Spark once the batch's sink committed, in
  fact when the next batch is planned) removes, in each queue, every
  message below its end.  The broker answers only once every replica of
  the view holds the removal, so an answered commit survives a failover
  and an unanswered one is simply repeated (it is idempotent).  The last
  batch of a run is committed when the query next starts from the
  checkpoint.
* The source must be each queue's ONLY consumer: the broker refuses a
  range read or commit while the queue has consumers (403, naming them)
  and refuses ``basic.consume``/``basic.get`` by others for 30 s after
  each read or commit.  ``failOnDataLoss`` (default true): a planned
  range whose messages vanished before they were read (TTL, max-length, a
  purge, another consumer) fails the query, naming the range; false only
  logs.

**Guarantee: exactly-once into idempotent (or transactional) sinks --
Spark's file sink (parquet...), which commits each batch once in its
metadata log, or a sink keyed by (queue, ``offset``) -- and at-least-once
into any other sink** (a batch whose sink write succeeded but whose
commit did not happen yet is replayed after a crash).  Assumes the
checkpoint survives (it holds the offset log); a queue deleted and
re-created restarts its offsets at 0, which the source cannot tell from
its own past.

Connections: every Python process Spark runs (the planning process, each
worker) keeps its AMQP connections open between micro-batches
(:func:`cached_handle`).

Options: ``nodes`` (host:port[,host:port...] AMQP listeners; required),
one of ``queue`` / ``queues`` / ``queuePattern``, ``vhost`` (/),
``user``/``password`` (guest), ``startingOffsets`` (``earliest`` = the
first live message, default; ``latest`` = only what comes after the
query starts; or JSON ``{"<queue>": N, ...}`` with -2 for earliest and
-1 for latest, queues not named starting at the earliest; one named
queue also takes ``{"offset": N}``), ``maxMessagesPerTrigger`` (default:
no limit), ``messagesPerPartition`` (10000), ``minPartitions`` (0),
``failOnDataLoss`` (true), ``timeout`` (s a call keeps failing over
between nodes; 60).

Columns: ``offset`` long, ``body`` binary, ``routing_key``, ``exchange``,
``headers`` map<string,string> (values as text; ``x-stream-offset``
removed), ``properties`` struct (content_type, content_encoding,
delivery_mode, priority, correlation_id, reply_to, expiration,
message_id, timestamp, type, user_id, app_id), ``redelivered`` boolean
(delivered to an ordinary consumer before), ``publish_time`` timestamp
(the AMQP ``timestamp`` property when the publisher set it, else null:
the broker keeps no clock of its own in the log).

Batch reads (``spark.read.format("mirrorq")``) read each queue's
``[startingOffsets, endingOffsets)`` (default earliest .. the log's end
when planned; the same forms) without removing anything and commit
nothing.

Writing (``df.writeStream.format("mirrorq")`` / ``df.write.format("mirrorq")``)
-----------------------------------------------------------------------------
Columns: ``body`` (binary or string; required), optional ``routing_key``,
``headers`` (map<string,string>); options ``nodes``, ``queue`` (routing
key when there is no routing_key column), ``exchange`` ("" = default),
``vhost``, ``user``, ``password``.  Each partition publishes its rows
persistent, pipelined, with publisher confirms, and the task fails unless
every confirm arrives.  Every message carries ``x-publisher-ref`` =
``"<query id>/<batch id>/<partition>"`` (batch writes: ``"<writer
id>/<partition>"``, fixed when the write is planned) and
``x-publishing-id`` = its row number in the partition (1, 2, 3...): the
master enqueues each (ref, id) once, so a replayed batch -- a task retry,
a restarted driver re-running the batch -- does not duplicate rows into
the queue.  Assumes a replayed partition holds the same rows in the same
order (true of a deterministic plan over a replayable source, such as
this one).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, cast

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

log = logging.getLogger("mirrorq.spark")

PROPERTY_FIELDS = [
    ("content_type", StringType()),
    ("content_encoding", StringType()),
    ("delivery_mode", IntegerType()),
    ("priority", IntegerType()),
    ("correlation_id", StringType()),
    ("reply_to", StringType()),
    ("expiration", StringType()),
    ("message_id", StringType()),
    ("timestamp", TimestampType()),
    ("type", StringType()),
    ("user_id", StringType()),
    ("app_id", StringType()),
]

SCHEMA = StructType(
    [
        StructField("offset", LongType(), False),
        StructField("body", BinaryType(), True),
        StructField("routing_key", StringType(), True),
        StructField("exchange", StringType(), True),
        StructField("headers", MapType(StringType(), StringType()), True),
        StructField("properties", StructType([StructField(n, t, True) for n, t in PROPERTY_FIELDS]), True),
        StructField("redelivered", BooleanType(), True),
        StructField("publish_time", TimestampType(), True),
    ]
)


class DataLoss(RuntimeError):
    pass


# ---- options ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Conn:
    """What a task needs to reach the queue (travels in every partition)."""

    nodes: str
    queue: str
    vhost: str = "/"
    user: str = "guest"
    password: str = "guest"
    timeout: float = 60.0

    def handle(self, start_node: int = 0):
        from mirrorq.spark.broker import QueueHandle

        return QueueHandle(
            self.nodes,
            self.queue,
            vhost=self.vhost,
            user=self.user,
            password=self.password,
            timeout=self.timeout,
            start_node=start_node,
        )


def _conn(options: Any, need_queue: bool = True) -> Conn:
    o = {k.lower(): v for k, v in dict(options).items()}
    for key in ("nodes", "queue") if need_queue else ("nodes",):
        if not o.get(key):
            raise ValueError(f"mirrorq: option '{key}' is required")
    from mirrorq.spark.broker import parse_nodes

    parse_nodes(o["nodes"])
    return Conn(
        o["nodes"],
        o.get("queue") or "",
        o.get("vhost", "/"),
        o.get("user", "guest"),
        o.get("password", "guest"),
        float(o.get("timeout", 60.0)),
    )


def _opt(options: Any, name: str, default: Any = None) -> Any:
    o = {k.lower(): v for k, v in dict(options).items()}
    return o.get(name.lower(), default)


def _bool(v: Any) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Subscription:
    """The queues a read covers: a fixed list (``queue`` / ``queues``) or
    every range-readable queue of the vhost whose name ``pattern`` matches
    whole (``queuePattern``), listed again at every planning call."""

    conn: Conn  # queue ""
    queues: tuple[str, ...] = ()
    pattern: str | None = None

    def current(self) -> list[str]:
        if self.pattern is None:
            return list(self.queues)
        return _call(self.conn, lambda h: h.list_queues(self.pattern))

    def conn_for(self, queue: str) -> Conn:
        return replace(self.conn, queue=queue)


def _subscription(options: Any) -> Subscription:
    base = _conn(options, need_queue=False)
    queue, queues, pattern = (_opt(options, k) for k in ("queue", "queues", "queuePattern"))
    given = [k for k, v in (("queue", queue), ("queues", queues), ("queuePattern", pattern)) if v]
    if len(given) != 1:
        raise ValueError(
            "mirrorq: give exactly one of the options 'queue', 'queues' (a comma-separated list) or "
            f"'queuePattern' (a regular expression over the vhost's queue names); got {given or 'none'}"
        )
    base = replace(base, queue="")
    if pattern:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"mirrorq: option 'queuePattern': {pattern!r} is not a regular expression: {e}") from None
        return Subscription(base, pattern=str(pattern))
    names = [queue] if queue else [q.strip() for q in str(queues).split(",") if q.strip()]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"mirrorq: option 'queues': expected distinct queue names, got {queues!r}")
    return Subscription(base, queues=tuple(names))


EARLIEST, LATEST = -2, -1  # Kafka's values for a queue in startingOffsets JSON


@dataclass(frozen=True)
class Starting:
    """``startingOffsets``: a default (EARLIEST / LATEST) and per-queue offsets."""

    default: int = EARLIEST
    queues: tuple[tuple[str, int], ...] = ()

    def of(self, queue: str) -> int:
        return dict(self.queues).get(queue, self.default)


def _starting(value: Any, sub: Subscription, what: str) -> Starting:
    """earliest | latest | JSON ``{"<queue>": N, ...}`` (-2 earliest, -1
    latest; queues not named start at the earliest) | ``{"offset": N}`` or
    N for a query of one named queue."""
    if value is None:
        return Starting()
    text = str(value).strip()
    if text in ("earliest", "latest"):
        return Starting(EARLIEST if text == "earliest" else LATEST)
    bad = ValueError(
        f"mirrorq: option '{what}' must be earliest, latest or JSON like {{\"<queue>\": 42}} "
        f"(-2 earliest, -1 latest); got {text!r}"
    )
    try:
        parsed = json.loads(text)
    except ValueError:
        raise bad from None
    single = sub.queues[0] if len(sub.queues) == 1 else None
    if isinstance(parsed, int) and not isinstance(parsed, bool) and single is not None:
        parsed = {single: parsed}
    if isinstance(parsed, dict) and single is not None and set(parsed) == {"offset"}:
        parsed = {single: parsed["offset"]}
    if not isinstance(parsed, dict):
        raise bad
    out = []
    for q, v in parsed.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < LATEST - 1:
            raise bad
        out.append((str(q), v))
    return Starting(EARLIEST, tuple(sorted(out)))


def offsets_of(offset: dict, sub: Subscription | None = None) -> dict[str, int]:
    """A Spark offset of this source as ``{queue: offset}``: ``{"queues":
    {...}}``, or ``{"offset": N}`` as checkpoints of one queue were
    written before queues were many."""
    qs = offset.get("queues")
    if isinstance(qs, dict):
        return {str(q): int(v) for q, v in qs.items()}
    if isinstance(offset.get("offset"), int) and sub is not None and len(sub.queues) == 1:
        return {sub.queues[0]: int(offset["offset"])}
    raise ValueError(f"mirrorq: not an offset of this query's queues: {offset!r}")


def spark_offset(offsets: dict[str, int]) -> dict:
    return {"queues": {q: offsets[q] for q in sorted(offsets)}}


# ---- rows ---------------------------------------------------------------------------------------
def _text(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=str)
    return str(v)


def _ts(v: Any) -> dt.datetime | None:
    if isinstance(v, dt.datetime):
        return v if v.tzinfo else v.replace(tzinfo=dt.UTC)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return dt.datetime.fromtimestamp(v, dt.UTC)
    return None


def to_row(d: Any) -> tuple:
    """One delivery of a range read as a row of :data:`SCHEMA`."""
    from mirrorq.spark.broker import offset_of

    p = d.properties
    headers = dict(p.headers or {})
    offset = offset_of(d)
    headers.pop("x-stream-offset", None)
    props = (
        _text(p.content_type),
        _text(p.content_encoding),
        p.delivery_mode,
        p.priority,
        _text(p.correlation_id),
        _text(p.reply_to),
        _text(p.expiration),
        _text(p.message_id),
        _ts(p.timestamp),
        _text(p.message_type),
        _text(p.user_id),
        _text(p.app_id),
    )
    return (
        offset,
        d.body,
        d.routing_key,
        d.exchange,
        {str(k): _text(v) for k, v in headers.items()},
        props,
        d.redelivered,
        _ts(p.timestamp),
    )


_ARROW_SCHEMA: Any = None


def arrow_schema() -> Any:
    """:data:`SCHEMA` as Arrow's schema (timestamps in UTC), as Spark converts it."""
    global _ARROW_SCHEMA
    if _ARROW_SCHEMA is None:
        from pyspark.sql.pandas.types import to_arrow_schema

        _ARROW_SCHEMA = to_arrow_schema(SCHEMA, timezone="UTC")
    return _ARROW_SCHEMA


def to_batch(rows: list[tuple]) -> Any:
    """Rows of :data:`SCHEMA` (:func:`to_row`) as one ``pyarrow.RecordBatch``,
    built column by column: what ``read()`` hands Spark (no per-row
    conversion in Spark's worker)."""
    import pyarrow as pa

    schema = arrow_schema()
    cols = list(zip(*rows, strict=True)) if rows else [()] * len(schema)
    arrays = []
    for i, field in enumerate(schema):
        values = cols[i]
        if pa.types.is_struct(field.type):
            children = list(zip(*values, strict=True)) if values else [()] * field.type.num_fields
            arrays.append(
                pa.StructArray.from_arrays(
                    [pa.array(c, type=f.type) for c, f in zip(children, field.type, strict=True)],
                    fields=list(field.type),
                )
            )
        elif pa.types.is_map(field.type):
            arrays.append(pa.array([list(m.items()) for m in values], type=field.type))
        else:
            arrays.append(pa.array(values, type=field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


# ---- reading --------------------------------------------------------------------------------------
@dataclass
class RangePartition(InputPartition):
    start: int
    end: int
    count: int  # live messages in [start, end) when planned
    conn: Conn
    fail_on_data_loss: bool
    index: int = 0


MAX_CACHED_HANDLES = 16  # open connections one Python process keeps between micro-batches
_handles: dict[tuple, Any] = {}


def cached_handle(conn: Conn, start_node: int = 0) -> Any:
    """A :class:`~mirrorq.spark.broker.QueueHandle` for ``conn``, kept open in
    this process for the next call (Spark reuses its Python workers and
    keeps the planning process for the query's life, so a micro-batch
    does not pay a connection).  At most :data:`MAX_CACHED_HANDLES`; the
    oldest is closed first.  A handle whose call failed is closed by
    :func:`drop_handle` (its connection may be half-read)."""
    key = (conn, start_node)
    h = _handles.get(key)
    if h is None:
        while len(_handles) >= MAX_CACHED_HANDLES:
            _handles.pop(next(iter(_handles))).close()
        h = _handles[key] = conn.handle(start_node=start_node)
    return h


def drop_handle(conn: Conn, start_node: int = 0) -> None:
    h = _handles.pop((conn, start_node), None)
    if h is not None:
        h.close()


def _call(conn: Conn, fn: Any) -> Any:
    """``fn(handle)`` on this process's cached handle for ``conn``."""
    try:
        return fn(cached_handle(conn))
    except BaseException:
        drop_handle(conn)
        raise


def _split(conn: Conn, start: int, end: int, per: int, fail: bool, first_index: int = 0) -> list[RangePartition]:
    """Split ``[start, end)`` of ``conn``'s queue into ranges of about ``per``
    live messages (one bounds call each); none if it holds nothing."""
    h = cached_handle(conn)
    try:
        parts: list[RangePartition] = []
        pos = start
        while pos < end:
            b = h.bounds(pos, per, until=end)
            if b["count"] == 0:
                break
            stop = min(int(b["end"]), end)
            parts.append(RangePartition(pos, stop, int(b["count"]), conn, fail, first_index + len(parts)))
            pos = stop
        if parts:
            parts[-1].end = end  # the last split reaches the range's end (nothing live in between)
        return parts
    except BaseException:
        drop_handle(conn)
        raise


def plan_partitions(
    sub: Subscription, ranges: dict[str, tuple[int, int]], per_partition: int, min_partitions: int, fail: bool
) -> list[RangePartition]:
    """Each queue's range ``[start, end)`` split into partitions of at most
    ``per_partition`` live messages, and into more where needed so that
    the batch has about ``min_partitions`` (each queue its share, by its
    messages: Kafka's ``minPartitions``)."""
    counts = {}
    for q, (s, e) in sorted(ranges.items()):
        if e > s:
            counts[q] = int(_call(sub.conn_for(q), lambda h, s=s, e=e: h.bounds(s, None, until=e))["count"])
    total = sum(counts.values())
    parts: list[RangePartition] = []
    for q, n in counts.items():
        if n == 0:
            continue
        want = max(math.ceil(n / per_partition), round(min_partitions * n / total) if min_partitions else 1, 1)
        s, e = ranges[q]
        parts += _split(sub.conn_for(q), s, e, math.ceil(n / want), fail, len(parts))
    return parts


def read_partition(p: RangePartition) -> Iterator[Any]:
    """The partition's messages as Arrow record batches, one per range-read call."""
    if p.end <= p.start:
        return
    h = cached_handle(p.conn, p.index)
    n = 0
    try:
        for chunk in h.read_chunks(p.start, p.end):
            n += len(chunk)
            yield to_batch([to_row(d) for d in chunk])
    except BaseException:
        drop_handle(p.conn, p.index)
        raise
    if n < p.count:
        msg = (
            f"mirrorq: queue '{p.conn.queue}': {p.count - n} of the {p.count} messages planned in offsets "
            f"[{p.start}, {p.end}) were gone when read (TTL, max-length, a purge or another consumer removed them)"
        )
        if p.fail_on_data_loss:
            raise DataLoss(msg + "; set failOnDataLoss=false to go on")
        log.warning(msg)


def _read_options(options: Any) -> tuple[int, int, bool]:
    per = int(_opt(options, "messagesPerPartition", 10000))
    mn = int(_opt(options, "minPartitions", 0) or 0)
    if per <= 0 or mn < 0:
        raise ValueError("mirrorq: 'messagesPerPartition' must be positive and 'minPartitions' not negative")
    return per, mn, _bool(_opt(options, "failOnDataLoss", "true"))


def _resolve(sub: Subscription, queue: str, spec: int) -> int:
    """A starting offset: ``spec`` itself, or the queue's earliest / latest now."""
    if spec >= 0:
        return spec
    b = _call(sub.conn_for(queue), lambda h: h.bounds())
    return int(b["first_offset"] if spec == EARLIEST else b["next_offset"])


def share(limit: int, available: dict[str, int]) -> dict[str, int]:
    """``limit`` messages shared among queues in proportion to what each has
    available (each at most its own), as Kafka shares maxOffsetsPerTrigger."""
    total = sum(available.values())
    if total <= limit:
        return dict(available)
    out = {q: limit * n // total for q, n in available.items()}
    left = limit - sum(out.values())
    for q in sorted(available, key=lambda q: (out[q] - limit * available[q] / total, q)):
        if left <= 0:
            break
        if out[q] < available[q]:
            out[q] += 1
            left -= 1
    return out


class MirrorqStreamReader(DataSourceStreamReader):
    def __init__(self, options: Any):
        self.sub = _subscription(options)
        self.starting = _starting(_opt(options, "startingOffsets"), self.sub, "startingOffsets")
        mx = _opt(options, "maxMessagesPerTrigger")
        self.max_per_trigger = int(mx) if mx not in (None, "") else None
        self.per_partition, self.min_partitions, self.fail = _read_options(options)

    def initialOffset(self) -> dict:
        return spark_offset({q: _resolve(self.sub, q, self.starting.of(q)) for q in self.sub.current()})

    def getDefaultReadLimit(self):
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

        return ReadMaxRows(self.max_per_trigger) if self.max_per_trigger else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: Any = None) -> dict:
        """Where the next batch ends in each queue (at most ``limit`` messages
        in all, shared by backlog); a queue the pattern newly matches starts
        at 0 (its earliest: offsets below the first live message hold
        nothing), one no longer listed is dropped; nothing new: ``start``."""
        from pyspark.sql.streaming.datasource import ReadMaxRows

        cur = offsets_of(start, self.sub)
        if self.sub.pattern is not None:
            listed = self.sub.current()
            cur = {q: cur.get(q, 0) for q in listed}
        mx = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        found = {q: _call(self.sub.conn_for(q), lambda h, s=s: h.bounds(s, mx)) for q, s in sorted(cur.items())}
        counts = {q: int(b["count"]) for q, b in found.items()}
        if sum(counts.values()) == 0:
            return spark_offset(cur)
        ends = {q: int(b["end"]) if counts[q] else cur[q] for q, b in found.items()}
        if mx is not None and sum(counts.values()) > mx:
            for q, n in share(mx, counts).items():
                if n < counts[q]:
                    ends[q] = (
                        int(_call(self.sub.conn_for(q), lambda h, s=cur[q], n=n: h.bounds(s, n))["end"])
                        if n
                        else cur[q]
                    )
        return spark_offset(ends)

    def partitions(self, start: dict, end: dict) -> list:
        s, e = offsets_of(start, self.sub), offsets_of(end, self.sub)
        ranges = {q: (s.get(q, 0), off) for q, off in e.items()}
        return plan_partitions(self.sub, ranges, self.per_partition, self.min_partitions, self.fail)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        # Spark hands back one of the partitions partitions() made
        return read_partition(cast(RangePartition, partition))

    def commit(self, end: dict) -> None:
        """Remove, in each queue, every message below the batch's end (Spark
        has committed the batch's sink); a queue the pattern no longer lists
        is skipped (deleted, it has nothing left to remove)."""
        offsets = offsets_of(end, self.sub)
        listed = set(self.sub.current()) if self.sub.pattern is not None else set(offsets)
        for q, off in sorted(offsets.items()):
            if q in listed:
                _call(self.sub.conn_for(q), lambda h, off=off: h.commit(off))

    def stop(self) -> None:
        pass


class MirrorqBatchReader(DataSourceReader):
    def __init__(self, options: Any):
        self.sub = _subscription(options)
        self.starting = _starting(_opt(options, "startingOffsets"), self.sub, "startingOffsets")
        ending = _opt(options, "endingOffsets")
        self.ending = _starting(ending if ending else "latest", self.sub, "endingOffsets")
        self.per_partition, self.min_partitions, self.fail = _read_options(options)

    def partitions(self) -> list:
        ranges = {}
        for q in self.sub.current():
            b = _call(self.sub.conn_for(q), lambda h: h.bounds())
            first, nxt = int(b["first_offset"]), int(b["next_offset"])
            sq, eq = self.starting.of(q), self.ending.of(q)
            s = sq if sq >= 0 else (first if sq == EARLIEST else nxt)
            e = min(eq if eq >= 0 else nxt, nxt)
            ranges[q] = (s, max(s, e))
        parts = plan_partitions(self.sub, ranges, self.per_partition, self.min_partitions, self.fail)
        return parts or [RangePartition(0, 0, 0, self.sub.conn, self.fail, 0)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        # Spark hands back one of the partitions partitions() made
        return read_partition(cast(RangePartition, partition))


# ---- writing --------------------------------------------------------------------------------------
@dataclass
class Published(WriterCommitMessage):
    ref: str
    rows: int


PUBLISH_CHUNK = 2000


def publish_rows(conn: Conn, exchange: str, ref: str, rows: Iterator[Any], start_node: int = 0) -> int:
    from pamqp import commands as C

    h = conn.handle(start_node=start_node)
    n = 0
    batch: list = []
    try:
        for row in rows:
            n += 1
            d = row.asDict() if hasattr(row, "asDict") else dict(row)
            body = d.get("body")
            if isinstance(body, str):
                body = body.encode()
            elif isinstance(body, (bytearray, memoryview)):
                body = bytes(body)
            if not isinstance(body, bytes):
                raise ValueError(f"mirrorq sink: column 'body' must be binary or string, got {type(body).__name__}")
            headers = {str(k): v for k, v in (d.get("headers") or {}).items()}
            headers["x-publisher-ref"] = ref
            headers["x-publishing-id"] = n
            props = C.Basic.Properties(delivery_mode=2, headers=headers)
            batch.append((d.get("routing_key"), body, props))
            if len(batch) >= PUBLISH_CHUNK:
                _flush(h, exchange, conn.queue, batch)
                batch = []
        if batch:
            _flush(h, exchange, conn.queue, batch)
    finally:
        h.close()
    return n


def _flush(h: Any, exchange: str, queue: str, batch: list) -> None:
    """Publish a chunk; rows with their own routing key go in runs of the same key."""
    i = 0
    while i < len(batch):
        rk = batch[i][0] or queue
        j = i
        while j < len(batch) and (batch[j][0] or queue) == rk:
            j += 1
        h.publish([(b, p) for _rk, b, p in batch[i:j]], exchange=exchange, routing_key=rk)
        i = j


def _task() -> tuple[int, Any]:
    from pyspark import TaskContext

    tc = TaskContext.get()
    if tc is None:
        return 0, None
    return tc.partitionId(), tc


class MirrorqStreamWriter(DataSourceStreamWriter):
    def __init__(self, options: Any):
        self.conn = _conn(options)
        self.exchange = _opt(options, "exchange", "") or ""

    def write(self, iterator: Iterator[Any]) -> Published:
        part, tc = _task()
        query = batch = None
        if tc is not None:
            query = tc.getLocalProperty("sql.streaming.queryId")
            batch = tc.getLocalProperty("streaming.sql.batchId")
        if query is None or batch is None:
            raise RuntimeError(
                "mirrorq sink: no streaming query id / batch id in the task's local properties: "
                "cannot derive a replay-safe publisher identity"
            )
        ref = f"{query}/{batch}/{part}"
        return Published(ref, publish_rows(self.conn, self.exchange, ref, iterator, start_node=part))

    def commit(self, messages: list, batchId: int) -> None:
        pass

    def abort(self, messages: list, batchId: int) -> None:
        pass


class MirrorqBatchWriter(DataSourceWriter):
    def __init__(self, options: Any):
        self.conn = _conn(options)
        self.exchange = _opt(options, "exchange", "") or ""
        self.writer_id = _opt(options, "writerId") or uuid.uuid4().hex  # fixed when the write is planned

    def write(self, iterator: Iterator[Any]) -> Published:
        part, _tc = _task()
        ref = f"{self.writer_id}/{part}"
        return Published(ref, publish_rows(self.conn, self.exchange, ref, iterator, start_node=part))


class MirrorqDataSource(DataSource):
    """``spark.dataSource.register(MirrorqDataSource)``, then ``format("mirrorq")``."""

    @classmethod
    def name(cls) -> str:
        return "mirrorq"

    def schema(self) -> StructType:
        return SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return MirrorqStreamReader(self.options)

    def reader(self, schema: StructType) -> DataSourceReader:
        return MirrorqBatchReader(self.options)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return MirrorqStreamWriter(self.options)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return MirrorqBatchWriter(self.options)


def register(spark: Any) -> None:
    """Register the source on a SparkSession (``format("mirrorq")``)."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    spark.dataSource.register(MirrorqDataSource)
