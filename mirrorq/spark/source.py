"""The ``mirrorq`` PySpark data source: stream and batch reads of a mirrored queue, stream and batch writes.

Reading (``spark.readStream.format("mirrorq")``)
------------------------------------------------
Offsets are the queue log's offsets (a message's PUBLISH record offset),
which name the same message on the master and on every mirror, including
after sync and after a promotion (:mod:`mirrorq.amqp.stream`).  Spark's
offset for this source is ``{"offset": N}``: everything below N is done.

* ``latestOffset(start, limit)`` asks the master where a range of at most
  ``limit`` (``maxMessagesPerTrigger``) live messages from ``start`` ends;
  nothing new: it returns ``start`` (no empty batches).  Spark writes the
  range to its checkpoint's offset log before the batch runs, so a batch
  is a *fixed* range ``[start, end)``.
* ``read(partition)`` reads its sub-range from the master WITHOUT removing
  anything (a range read), so a batch read again -- a task retry, a
  restarted driver replaying the uncommitted batch from its checkpoint, a
  read resumed on a new master after a failover -- yields the same
  messages at the same offsets, in offset order.
* ``commit(end)`` (called by Spark once the batch's sink committed, in
  fact when the next batch is planned) removes every message below
  ``end``.  The broker answers only once every replica of the view holds
  the removal, so an answered commit survives a failover and an
  unanswered one is simply repeated (it is idempotent).  The last batch of
  a run is committed when the query next starts from the checkpoint.
* The source must be the queue's ONLY consumer: the broker refuses a range
  read or commit while the queue has consumers (403, naming them) and
  refuses ``basic.consume``/``basic.get`` by others for 30 s after each
  read or commit.  ``failOnDataLoss`` (default true): a planned range whose
  messages vanished before they were read (TTL, max-length, a purge,
  another consumer) fails the query, naming the range; false only logs.

**Guarantee: exactly-once into idempotent (or transactional) sinks --
Spark's file sink (parquet...), which commits each batch once in its
metadata log, or a sink keyed by ``offset`` -- and at-least-once into any
other sink** (a batch whose sink write succeeded but whose commit did not
happen yet is replayed after a crash).  Assumes the checkpoint survives
(it holds the offset log); a queue deleted and re-created restarts its
offsets at 0, which the source cannot tell from its own past.

Options: ``nodes`` (host:port[,host:port...] AMQP listeners; required),
``queue`` (required), ``vhost`` (/), ``user``/``password`` (guest),
``startingOffsets`` (``earliest`` = the first live message, default;
``latest`` = only what comes after the query starts; or JSON
``{"offset": N}`` / ``{"<queue>": N}``), ``maxMessagesPerTrigger``
(default: no limit), ``messagesPerPartition`` (10000: a batch is split
into partitions of about this many messages), ``failOnDataLoss`` (true),
``timeout`` (s a call keeps failing over between nodes; 60).

Columns: ``offset`` long, ``body`` binary, ``routing_key``, ``exchange``,
``headers`` map<string,string> (values as text; ``x-stream-offset``
removed), ``properties`` struct (content_type, content_encoding,
delivery_mode, priority, correlation_id, reply_to, expiration,
message_id, timestamp, type, user_id, app_id), ``redelivered`` boolean
(delivered to an ordinary consumer before), ``publish_time`` timestamp
(the AMQP ``timestamp`` property when the publisher set it, else null:
the broker keeps no clock of its own in the log).

Batch reads (``spark.read.format("mirrorq")``) read ``[startingOffsets,
endingOffsets)`` (default earliest .. the log's end when planned) without
removing anything and commit nothing.

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
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
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


def _conn(options: Any) -> Conn:
    o = {k.lower(): v for k, v in dict(options).items()}
    for key in ("nodes", "queue"):
        if not o.get(key):
            raise ValueError(f"mirrorq: option '{key}' is required")
    from mirrorq.spark.broker import parse_nodes

    parse_nodes(o["nodes"])
    return Conn(
        o["nodes"],
        o["queue"],
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


def _offset_spec(value: Any, queue: str, what: str) -> int | str:
    if value is None:
        return "earliest"
    text = str(value).strip()
    if text in ("earliest", "latest"):
        return text
    try:
        parsed = json.loads(text)
    except ValueError:
        raise ValueError(
            f"mirrorq: option '{what}' must be earliest, latest or JSON like {{\"offset\": 42}}; got {text!r}"
        ) from None
    if isinstance(parsed, int) and parsed >= 0:
        return parsed
    if isinstance(parsed, dict):
        for key in ("offset", queue):
            v = parsed.get(key)
            if isinstance(v, int) and v >= 0:
                return v
    raise ValueError(f"mirrorq: option '{what}': no non-negative offset for queue '{queue}' in {text!r}")


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


def _split(conn: Conn, start: int, end: int, per: int, fail: bool) -> list[RangePartition]:
    """Split ``[start, end)`` into ranges of about ``per`` live messages (one bounds call each)."""
    h = cached_handle(conn)
    try:
        parts: list[RangePartition] = []
        pos = start
        while pos < end:
            b = h.bounds(pos, per, until=end)
            if b["count"] == 0:
                break
            stop = min(int(b["end"]), end)
            parts.append(RangePartition(pos, stop, int(b["count"]), conn, fail, len(parts)))
            pos = stop
        if parts:
            parts[-1].end = end  # the last split reaches the batch's end (nothing live in between)
        return parts or [RangePartition(start, end, 0, conn, fail, 0)]
    except BaseException:
        drop_handle(conn)
        raise


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


class MirrorqStreamReader(DataSourceStreamReader):
    def __init__(self, options: Any):
        self.conn = _conn(options)
        self.starting = _offset_spec(_opt(options, "startingOffsets"), self.conn.queue, "startingOffsets")
        mx = _opt(options, "maxMessagesPerTrigger")
        self.max_per_trigger = int(mx) if mx not in (None, "") else None
        self.per_partition = int(_opt(options, "messagesPerPartition", 10000))
        self.fail = _bool(_opt(options, "failOnDataLoss", "true"))

    def initialOffset(self) -> dict:
        if isinstance(self.starting, int):
            return {"offset": self.starting}
        b = _call(self.conn, lambda h: h.bounds())
        return {"offset": b["first_offset"] if self.starting == "earliest" else b["next_offset"]}

    def getDefaultReadLimit(self):
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

        return ReadMaxRows(self.max_per_trigger) if self.max_per_trigger else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: Any = None) -> dict:
        from pyspark.sql.streaming.datasource import ReadMaxRows

        s = int(start["offset"])
        mx = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        b = _call(self.conn, lambda h: h.bounds(s, mx))
        if b["count"] == 0:
            return {"offset": s}
        return {"offset": int(b["end"])}

    def partitions(self, start: dict, end: dict) -> list:
        s, e = int(start["offset"]), int(end["offset"])
        if e <= s:
            return []
        return _split(self.conn, s, e, self.per_partition, self.fail)

    def read(self, partition: InputPartition) -> Iterator[tuple]:
        # Spark hands back one of the partitions partitions() made
        return read_partition(cast(RangePartition, partition))

    def commit(self, end: dict) -> None:
        _call(self.conn, lambda h: h.commit(int(end["offset"])))

    def stop(self) -> None:
        pass


class MirrorqBatchReader(DataSourceReader):
    def __init__(self, options: Any):
        self.conn = _conn(options)
        self.starting = _offset_spec(_opt(options, "startingOffsets"), self.conn.queue, "startingOffsets")
        ending = _opt(options, "endingOffsets")
        self.ending = _offset_spec(ending, self.conn.queue, "endingOffsets") if ending else "latest"
        self.per_partition = int(_opt(options, "messagesPerPartition", 10000))
        self.fail = _bool(_opt(options, "failOnDataLoss", "true"))

    def partitions(self) -> list:
        b = _call(self.conn, lambda h: h.bounds())
        s = (
            self.starting
            if isinstance(self.starting, int)
            else (b["first_offset"] if self.starting == "earliest" else b["next_offset"])
        )
        e = self.ending if isinstance(self.ending, int) else b["next_offset"]
        e = min(e, b["next_offset"])
        if e <= s:
            return [RangePartition(s, s, 0, self.conn, self.fail, 0)]
        return _split(self.conn, s, e, self.per_partition, self.fail)

    def read(self, partition: InputPartition) -> Iterator[tuple]:
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
