"""The source's planning arithmetic and row batches, without a cluster or a JVM:
sharing maxMessagesPerTrigger among queues, startingOffsets, offsets as
checkpoints hold them (old and new), option checks, and Arrow batches that
match the schema Spark expects."""

from __future__ import annotations

import datetime as dt

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from mirrorq.amqp.client import Delivery, Properties  # noqa: E402
from mirrorq.spark.source import (  # noqa: E402
    EARLIEST,
    LATEST,
    _starting,
    _subscription,
    arrow_schema,
    offsets_of,
    share,
    spark_offset,
    to_batch,
    to_row,
)

NODES = "127.0.0.1:5672"


def test_share_is_proportional_bounded_and_exact():
    assert share(100, {"a": 10, "b": 20}) == {"a": 10, "b": 20}  # everything fits
    got = share(100, {"a": 300, "b": 100, "c": 0})
    assert got == {"a": 75, "b": 25, "c": 0}
    got = share(10, {"a": 7, "b": 7, "c": 7})
    assert sum(got.values()) == 10 and all(0 <= got[q] <= 7 for q in got) and max(got.values()) - min(got.values()) <= 1
    got = share(5, {"a": 1, "b": 1000})
    assert sum(got.values()) == 5 and got["a"] <= 1


def test_exactly_one_way_to_name_queues():
    with pytest.raises(ValueError, match="exactly one"):
        _subscription({"nodes": NODES})
    with pytest.raises(ValueError, match="exactly one"):
        _subscription({"nodes": NODES, "queue": "a", "queuePattern": "a.*"})
    with pytest.raises(ValueError, match="not a regular expression"):
        _subscription({"nodes": NODES, "queuePattern": "a("})
    assert _subscription({"nodes": NODES, "queues": "a, b"}).queues == ("a", "b")
    assert _subscription({"nodes": NODES, "queuePattern": r"orders\..*"}).pattern == r"orders\..*"
    assert _subscription({"nodes": NODES, "queue": "a"}).conn_for("a").queue == "a"


def test_starting_offsets_per_queue_and_the_one_queue_forms():
    one = _subscription({"nodes": NODES, "queue": "a"})
    many = _subscription({"nodes": NODES, "queues": "a,b"})
    assert _starting(None, many, "s").of("a") == EARLIEST
    assert _starting("latest", many, "s").of("b") == LATEST
    st = _starting('{"a": 42, "b": -1}', many, "s")
    assert (st.of("a"), st.of("b"), st.of("c")) == (42, LATEST, EARLIEST)
    assert _starting('{"offset": 7}', one, "s").of("a") == 7
    assert _starting("7", one, "s").of("a") == 7
    with pytest.raises(ValueError, match="startingOffsets"):
        _starting("7", many, "startingOffsets")
    with pytest.raises(ValueError, match="s"):
        _starting('{"a": "x"}', many, "s")


def test_offsets_old_and_new_checkpoints():
    one = _subscription({"nodes": NODES, "queue": "a"})
    assert offsets_of({"offset": 5}, one) == {"a": 5}  # a checkpoint written by the one-queue source
    assert offsets_of(spark_offset({"b": 2, "a": 1})) == {"a": 1, "b": 2}
    assert list(spark_offset({"b": 2, "a": 1})["queues"]) == ["a", "b"]  # one JSON text per position
    with pytest.raises(ValueError):
        offsets_of({"offset": 5}, _subscription({"nodes": NODES, "queues": "a,b"}))


def test_batch_matches_the_schema_and_the_rows():
    ts = dt.datetime(2026, 11, 29, 20, 0, tzinfo=dt.UTC)
    ds = [
        Delivery("t", 1, False, "", "q", Properties(headers={"x-stream-offset": 3}), b"a"),
        Delivery(
            "t",
            2,
            True,
            "ex",
            "rk",
            Properties(
                content_type="text/plain",
                headers={"x-stream-offset": 9, "k": b"v", "n": 1, "d": {"x": 1}},
                delivery_mode=2,
                priority=4,
                message_id="m",
                timestamp=ts,
                message_type="t",
            ),
            b"",
        ),
    ]
    rows = [to_row(d) for d in ds]
    b = to_batch(rows)
    assert b.schema == arrow_schema() and b.num_rows == 2
    got = b.to_pylist()
    assert [r["offset"] for r in got] == [3, 9]
    assert [r["body"] for r in got] == [b"a", b""]
    assert dict(got[1]["headers"]) == {"k": "v", "n": "1", "d": '{"x": 1}'}  # x-stream-offset removed
    assert got[1]["properties"]["message_id"] == "m" and got[1]["properties"]["timestamp"] == ts
    assert got[1]["publish_time"] == ts and got[0]["publish_time"] is None
    assert got[1]["redelivered"] is True and got[1]["exchange"] == "ex"
    assert to_batch([]).num_rows == 0
