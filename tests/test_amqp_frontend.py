"""The AMQP front end's channel identities and reply routing.

A queue master remembers every publisher's high-water mark (replicated, for
ever) and confirms without storing any publish at or below it, taking it for
a resend.  A node restarted after a kill may get, for its new front end, the
very ``host:port`` its dead one had; if its channels were numbered as the old
ones were, a new publisher's messages would be confirmed and dropped (the
30-minute nemesis run lost 4203 confirmed messages exactly so).
"""

from __future__ import annotations

import random

from mirrorq.amqp import connection as cn
from mirrorq.amqp.frontend import TXN_RETRY_FOR, FrontEnd
from mirrorq.node.messages import RegistryResult, RegistryTxn
from mirrorq.queues import messages as qm
from mirrorq.sansio import Emit


class Host:
    def __init__(self) -> None:
        self.sent: list = []
        self.agent: list = []

    def fe_write(self, no, data):
        return True

    def fe_close(self, no, reason, linger=False):
        pass

    def fe_send(self, dst, msg):
        self.sent.append((dst, msg))

    def fe_backlog(self, no):
        return 0

    def fe_agent(self, msg):
        self.agent.append(msg)

    def fe_manager(self, msg):
        pass

    def fe_tick_soon(self):
        pass

    def fe_log(self, event, level, fields):
        pass


DST = "127.0.0.1:45881"


def _uid_bases(fe: FrontEnd, n: int) -> list[int]:
    return [fe.conns[fe.open(0.0, "127.0.0.1", 50000 + i)].conn.uid_base for i in range(n)]


def test_a_front_end_at_a_reused_address_numbers_its_channels_unlike_the_dead_one():
    dead = FrontEnd(Host(), node="n3", dst=DST)
    before = _uid_bases(dead, 50)
    restarted = FrontEnd(Host(), node="n3", dst=DST)  # same node, same address, counters from zero
    after = _uid_bases(restarted, 50)
    assert len(set(before)) == 50 and len(set(after)) == 50
    assert not set(before) & set(after)
    for base in before + after:
        assert base % 2**32 == 0 and 0 < base < 2**64  # channel numbers base + n fit msgpack


def test_a_master_reply_reaches_the_connection_whose_channel_it_names():
    rng = random.Random(7)

    def seeded_key(taken):
        while (k := rng.randrange(1, 2**32)) in taken:
            pass
        return k

    fe = FrontEnd(Host(), node="n1", dst=DST, channel_key=seeded_key)
    got: dict[int, list] = {}
    nos = [fe.open(0.0, "127.0.0.1", 50000 + i) for i in range(5)]
    for no in nos:
        got[no] = []
        fe.conns[no].conn.receive = lambda now, src, msg, no=no: got[no].append(msg) or []
    for no in nos:
        uid = fe.conns[no].conn.uid_base + 3
        assert fe.message(1.0, "master", qm.Confirm("q", (DST, uid), (1,), ()))
    assert all(len(got[no]) == 1 and got[no][0].publisher == (DST, fe.conns[no].conn.uid_base + 3) for no in nos)
    # a reply for a connection that is gone (its key released) reaches nobody
    gone = nos[0]
    base = fe.conns[gone].conn.uid_base
    fe.lost(2.0, gone)
    fe.message(3.0, "master", qm.Confirm("q", (DST, base + 3), (2,), ()))
    assert all(len(v) == 1 for v in got.values())


def test_channel_key_never_returns_a_taken_key():
    taken = set()
    for _ in range(1000):
        k = qm.channel_key(taken)
        assert 0 < k < 2**32 and k not in taken
        taken.add(k)


def test_a_transaction_lost_to_a_leader_change_is_sent_again_not_failed_to_the_client():
    host = Host()
    fe = FrontEnd(host, node="n1", dst=DST)
    no = fe.open(0.0, "127.0.0.1", 50000)
    c = fe.conns[no]
    results = []
    c.conn.registry_result = lambda now, tag, ok, error="": results.append((tag, ok, error)) or []
    txn = {"ops": [{"op": "put", "table": "exchange", "key": ["/", "x"], "record": {"vhost": "/", "name": "x"}}]}
    fe._do(1.0, c, [Emit(cn.RegistryRequest(7, txn))])
    sent = [m for m in host.agent if isinstance(m, RegistryTxn)]
    assert len(sent) == 1 and sent[0].txn == txn
    fe.message(
        1.5,
        "agent",
        RegistryResult(False, "registry leader n2 changed before answering; outcome unknown, retry", ref=sent[0].ref),
    )
    again = [m for m in host.agent if isinstance(m, RegistryTxn)]
    assert len(again) == 2 and again[1].txn == txn and again[1].ref != sent[0].ref and results == []
    fe.message(2.0, "agent", RegistryResult(True, ref=again[1].ref))
    assert results == [(7, True, "")]
    # a refusal that is not about the outcome (a failed check) reaches the client at once
    fe._do(3.0, c, [Emit(cn.RegistryRequest(8, txn))])
    m = [m for m in host.agent if isinstance(m, RegistryTxn)][-1]
    fe.message(
        3.1, "agent", RegistryResult(False, "precondition failed: amqqueue ['/', 'q'] does not exist", ref=m.ref)
    )
    assert results[-1][:2] == (8, False)
    # and one whose outcome stays unknown for too long, too
    fe._do(10.0, c, [Emit(cn.RegistryRequest(9, txn))])
    m = [m for m in host.agent if isinstance(m, RegistryTxn)][-1]
    fe.message(
        10.0 + TXN_RETRY_FOR + 1, "agent", RegistryResult(False, "no registry leader within 2.0s; retry", ref=m.ref)
    )
    assert results[-1][:2] == (9, False)


def test_every_connection_gets_the_nodes_max_message_size():
    """node.yaml's max_message_size (the shells pass it on) reaches every connection."""
    fe = FrontEnd(Host(), node="n1", dst=DST, max_message_size=5000)
    no = fe.open(0.0, "127.0.0.1")
    assert fe.conns[no].conn.max_message_size == 5000
    fe = FrontEnd(Host(), node="n1", dst=DST, max_message_size=None)  # not in node.yaml: the default
    no = fe.open(0.0, "127.0.0.1")
    assert fe.conns[no].conn.max_message_size == 16 << 20


def test_link_credit_goes_back_only_once_the_clients_socket_took_what_it_was_sent():
    """The front end gives link credit back (Connection.grant_credit) after
    a turn only while the shell holds at most CLIENT_BACKLOG for the client;
    a client that does not read keeps it back until the shell reports it
    drained."""
    from mirrorq.amqp import connection as cn

    class Backlogged(Host):
        backlog = 0

        def fe_backlog(self, no):
            return self.backlog

    host = Backlogged()
    fe = FrontEnd(host, node="n1", dst=DST)
    no = fe.open(0.0, "127.0.0.1", 50000)
    conn = fe.conns[no].conn
    granted = []

    def grant_credit(now):
        granted.append(now)
        conn.ungranted = 0
        return []

    def receive(now, src, msg):  # as if it wrote a delivery of GRANT_BYTES to the client
        conn.ungranted += cn.GRANT_BYTES
        return []

    conn.grant_credit, conn.receive = grant_credit, receive
    uid = conn.uid_base + 1
    host.backlog = cn.CLIENT_BACKLOG + 1  # the client is not reading
    fe.message(1.0, "master", qm.Confirm("q", (DST, uid), (1,), ()))
    assert conn.wants_credit() and granted == []
    fe.drained(2.0, no)  # the shell wrote it out
    assert granted == [2.0] and not conn.wants_credit()
    host.backlog = 0  # a client that reads: credit goes back in the same turn
    fe.message(3.0, "master", qm.Confirm("q", (DST, uid), (2,), ()))
    assert granted == [2.0, 3.0]
