"""The dead-letter router's core (mirrorq.amqp.dead_letter), without a cluster."""

from __future__ import annotations

from pamqp import commands as C
from pamqp import header as H

from mirrorq.amqp.dead_letter import DeadLetterRouter, is_cycle, rewrite
from mirrorq.amqp.topology import Topology, arguments_key
from mirrorq.queues import messages as qm
from mirrorq.sansio import Send

T1, T2 = "n1/h:1/t1", "n2/h:2/t2"


def topo() -> Topology:
    t = Topology()
    for name, kind in (("fan", "fanout"), ("direct", "direct")):
        t.put(
            "exchange",
            {
                "vhost": "/",
                "name": name,
                "type": kind,
                "durable": True,
                "auto_delete": False,
                "internal": False,
                "arguments": {},
            },
        )
    for q, pid in (("t1", T1), ("t2", T2)):
        t.put(
            "amqqueue",
            {
                "vhost": "/",
                "name": q,
                "pid": pid,
                "durable": True,
                "auto_delete": False,
                "exclusive_owner": None,
                "arguments": {},
            },
        )
        t.put(
            "binding",
            {
                "vhost": "/",
                "source": "fan",
                "destination_kind": "queue",
                "destination": q,
                "routing_key": "",
                "arguments_key": "",
                "arguments": {},
            },
        )
    t.put(
        "binding",
        {
            "vhost": "/",
            "source": "direct",
            "destination_kind": "queue",
            "destination": "t1",
            "routing_key": "k",
            "arguments_key": "",
            "arguments": {},
        },
    )
    return t


def header(**props) -> bytes:
    return H.ContentHeader(0, 3, C.Basic.Properties(**props)).marshal()


def decode(h: bytes) -> C.Basic.Properties:
    ch = H.ContentHeader()
    ch.unmarshal(h)
    return ch.properties


def dl(items, exchange="fan", rk=None, queue="src"):
    return qm.DeadLetter(queue, "/", "master-dst", exchange, rk, tuple(items), "inc", 1_700_000_000.0)


def item(seq, reason="rejected", rk="src", **props):
    return (seq, b"abc", {"_h": header(**props), "_x": "", "_k": rk}, reason, True)


def sends(actions, kind):
    return [a for a in actions if isinstance(a, Send) and isinstance(a.msg, kind)]


def test_x_death_is_added_then_counted_and_moved_to_the_front():
    h, history, _ = rewrite(
        3,
        {"_h": header(expiration="5000", headers={"app": "v"}), "_x": "ex", "_k": "rk"},
        "q1",
        "expired",
        1_700_000_000.0,
    )
    p = decode(h)
    (d,) = p.headers["x-death"]
    assert (d["count"], d["reason"], d["queue"], d["exchange"], d["routing-keys"]) == (1, "expired", "q1", "ex", ["rk"])
    assert d["original-expiration"] == "5000" and p.expiration is None and p.headers["app"] == "v"
    assert (p.headers["x-first-death-reason"], p.headers["x-first-death-queue"]) == ("expired", "q1")
    h2, history, _ = rewrite(3, {"_h": h, "_x": "", "_k": "q2"}, "q2", "rejected", 1_700_000_001.0)
    h3, history, _ = rewrite(3, {"_h": h2, "_x": "ex", "_k": "rk"}, "q1", "expired", 1_700_000_002.0)
    deaths = decode(h3).headers["x-death"]
    assert [(d["queue"], d["reason"], d["count"]) for d in deaths] == [("q1", "expired", 2), ("q2", "rejected", 1)]
    assert history == [("q1", "expired"), ("q2", "rejected")]
    assert decode(h3).headers["x-first-death-queue"] == "q1"


def test_a_cycle_needs_no_rejection_on_the_way():
    assert is_cycle("q1", [("q1", "expired")])
    assert is_cycle("q1", [("q2", "expired"), ("q1", "maxlen")])
    assert not is_cycle("q1", [("q2", "rejected"), ("q1", "expired")])
    assert not is_cycle("q3", [("q2", "expired"), ("q1", "expired")])


def test_published_to_every_target_and_answered_once_all_confirmed():
    r = DeadLetterRouter(topo(), "fe:1", key=7)
    acts = r.dead_letter(0, dl([item(10), item(11)]))
    pubs = sends(acts, qm.Publish)
    assert sorted(s.dst for s in pubs) == [T1, T2]
    for s in pubs:
        assert [it[2]["_d"] for it in s.msg.items] == [["//src/inc", 10], ["//src/inc", 11]]
        assert s.msg.publisher[1] >> 32 == 7  # the shell routes replies by this key
    # a resend while in progress is not published again
    assert sends(r.dead_letter(0, dl([item(10), item(11)])), qm.Publish) == []
    p1 = next(s.msg for s in pubs if s.dst == T1)
    assert r.receive(0, T1, qm.Confirm("t1", p1.publisher, (1, 2))) == []  # t2 has not confirmed yet
    p2 = next(s.msg for s in pubs if s.dst == T2)
    (done,) = sends(r.receive(0, T2, qm.Confirm("t2", p2.publisher, (1,), (2,), "full")), qm.DeadLetterDone)
    assert done.dst == "master-dst" and done.msg == qm.DeadLetterDone("src", (10, 11))
    assert r.stats["dropped"] == 1  # 11 refused by t2 (full): dropped there, as RabbitMQ does
    assert r.items == {}


def test_routed_through_a_headers_exchange_by_the_message_headers():
    # aio-pika's RPC: the caller's queue is bound to a headers exchange
    # (x-match any, From = its name); an expired call comes back through it
    t = topo()
    t.put(
        "exchange",
        {
            "vhost": "/",
            "name": "dlx",
            "type": "headers",
            "durable": False,
            "auto_delete": True,
            "internal": False,
            "arguments": {},
        },
    )
    for q in ("t1", "t2"):
        args = {"From": q, "x-match": "any"}
        t.put(
            "binding",
            {
                "vhost": "/",
                "source": "dlx",
                "destination_kind": "queue",
                "destination": q,
                "routing_key": "",
                "arguments_key": arguments_key(args),
                "arguments": args,
            },
        )
    r = DeadLetterRouter(t, "fe:1", key=7)
    pubs = sends(r.dead_letter(0, dl([item(1, reason="expired", headers={"From": "t1"})], exchange="dlx")), qm.Publish)
    assert [s.dst for s in pubs] == [T1]
    assert decode(pubs[0].msg.items[0][2]["_h"]).headers["From"] == "t1"
    pubs = sends(r.dead_letter(0, dl([item(2, reason="rejected", headers={"From": "t2"})], exchange="dlx")), qm.Publish)
    assert [s.dst for s in pubs] == [T2]
    acts = r.dead_letter(0, dl([item(3, reason="expired", headers={"From": "other"})], exchange="dlx"))
    assert sends(acts, qm.Publish) == [] and sends(acts, qm.DeadLetterDone)[0].msg.seqs == (3,)


def test_unroutable_and_cyclic_messages_are_answered_at_once():
    r = DeadLetterRouter(topo(), "fe:1", key=7)
    acts = r.dead_letter(0, dl([item(1, rk="nope")], exchange="direct"))
    assert sends(acts, qm.Publish) == [] and sends(acts, qm.DeadLetterDone)[0].msg.seqs == (1,)
    acts = r.dead_letter(0, dl([item(2, reason="expired")], exchange="", rk="src"))  # back into itself
    assert sends(acts, qm.Publish) == [] and r.stats["cycles"] == 0  # "src" is not a queue here: no route
    t = topo()
    t.put(
        "amqqueue",
        {
            "vhost": "/",
            "name": "src",
            "pid": "n/h:3/s",
            "durable": True,
            "auto_delete": False,
            "exclusive_owner": None,
            "arguments": {},
        },
    )
    r = DeadLetterRouter(t, "fe:1", key=7)
    acts = r.dead_letter(0, dl([item(3, reason="expired")], exchange="", rk="src"))
    assert sends(acts, qm.Publish) == [] and r.stats["cycles"] == 1
    assert sends(acts, qm.DeadLetterDone)[0].msg.seqs == (3,)


def test_a_target_deleted_or_moved():
    r = DeadLetterRouter(topo(), "fe:1", key=7)
    pubs = sends(r.dead_letter(0, dl([item(5)], exchange="direct", rk="k")), qm.Publish)
    assert [s.dst for s in pubs] == [T1]
    moved = r.queue_moved(0, "/", "t1", {"pid": "n3/h:3/t1b"})
    assert [s.dst for s in sends(moved, qm.Publish)] == ["n3/h:3/t1b"]  # resent to the new master
    (done,) = sends(r.queue_moved(0, "/", "t1", None), qm.DeadLetterDone)
    assert done.msg.seqs == (5,)
