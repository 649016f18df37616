"""The record upkeep core (:mod:`mirrorq.queues.record_upkeep`), both flavours.

Its transactions run against the registry state machine
(:class:`~mirrorq.mnesia_like.registry.Registry`), so a fence is tested by
what the registry refuses, not by the transaction's text: a classic
master's writes are fenced by its GM view (a deposed master's late write is
refused and its successor's record stays), a quorum leader's by its term
(a row of a higher term is never written over; a put raced by a newer
leader's is refused).  :class:`Agent` stands for the node agent: it holds
the upkeep's requests until the test delivers them, in the order it
chooses."""

from __future__ import annotations

from mirrorq.gm.core import ProposeView
from mirrorq.gm.names import create_txn, propose_txn
from mirrorq.mnesia_like.registry import Registry
from mirrorq.node.messages import RegistryGet, RegistryResult, RegistryRows, RegistryTxn
from mirrorq.queues.messages import epoch
from mirrorq.queues.record_upkeep import (
    RECORD_RETRY,
    RECORD_RETRY_MAX,
    RETRY_TIMER,
    RecordUpkeep,
    RowKey,
    RowsDeleted,
    Superseded,
    TermFence,
    UpkeepDone,
    ViewFence,
    Wanted,
    WriteRefused,
    is_answer,
    write_txn,
)
from mirrorq.quorum.hosted import MEMBER_TABLE, member_row_put, record_of
from mirrorq.sansio import CancelTimer, Emit, Send, SetTimer

GROUP = "/ q"
KEY = ("/", "q")


# ---- the two flavours' wants -------------------------------------------------------------------
def classic(master: str, members: list[str], version: int | None) -> Wanted:
    fields = {
        "pid": master,
        "slave_pids": [m for m in members if m != master],
        "sync_slave_pids": [m for m in members if m != master],
        "gm_pids": list(members),
        "state": "live",
    }
    row = {
        "name": "q",
        "vhost": "/",
        "durable": True,
        "auto_delete": False,
        "exclusive_owner": None,
        "arguments": {},
        "incarnation": "i1",
        **fields,
    }
    return Wanted(fields, row, ViewFence(GROUP, version))


SPEC = {"name": "q", "vhost": "/", "arguments": {"x-queue-type": "quorum"}, "incarnation": "i1"}
MEMBERS = ["a/quorum/1", "b/quorum/2", "c/quorum/3"]


def quorum(
    member: str | None, term: int, members: list[str] = MEMBERS, gone: tuple[str, ...] = (), dst: str | None = "d"
) -> Wanted:
    pid = None if member is None else epoch(member, term)
    fields = {"pid": pid, "leader_dst": dst, "members": list(members)}
    row = record_of(SPEC, members, pid, dst, MEMBERS)
    deletes = tuple(RowKey(MEMBER_TABLE, (GROUP, m)) for m in gone)
    return Wanted(fields, row, TermFence(term), whole=True, deletes=deletes)


# ---- the node agent in miniature ------------------------------------------------------------------
class Agent:
    """Holds the upkeeps' requests; :meth:`deliver` answers them from the registry."""

    def __init__(self, reg: Registry) -> None:
        self.reg = reg
        self.held: list[tuple[RecordUpkeep, object]] = []

    def take(self, up: RecordUpkeep, actions: list) -> list:
        """Hold ``up``'s sends; the rest of its actions back."""
        rest = []
        for a in actions:
            if isinstance(a, Send):
                assert a.dst == up.agent
                self.held.append((up, a.msg))
            else:
                rest.append(a)
        return rest

    def answer(self, msg: object) -> object:
        if isinstance(msg, RegistryGet):
            row = self.reg.get(msg.table, msg.key)
            return RegistryRows(True, [] if row is None else [row], ref=msg.ref)
        assert isinstance(msg, RegistryTxn)
        res = self.reg.apply(msg.txn)
        return RegistryResult(res.ok, res.error, ref=msg.ref)

    def deliver(self, now: float, kind: type | None = None, up: RecordUpkeep | None = None) -> list:
        """Answer the first held request (of ``kind``, of ``up``); the upkeep's actions."""
        i = next(
            i for i, (u, m) in enumerate(self.held) if (kind is None or isinstance(m, kind)) and (up is None or u is up)
        )
        u, msg = self.held.pop(i)
        reply = self.answer(msg)
        assert is_answer(reply)
        return self.take(u, u.receive(now, "agent", reply))

    def drain(self, now: float) -> list:
        """Answer everything held, and what the answers bring, in order."""
        out = []
        while self.held:
            out += self.deliver(now)
        return out

    def writes(self) -> list[RegistryTxn]:
        return [m for _u, m in self.held if isinstance(m, RegistryTxn)]


def events(actions: list, kind: type) -> list:
    return [a.event for a in actions if isinstance(a, Emit) and isinstance(a.event, kind)]


def founded(members: list[str]) -> Registry:
    reg = Registry()
    assert reg.apply(create_txn(GROUP, members)).ok
    return reg


# ---- the transactions against the registry ---------------------------------------------------
def test_view_fence_a_deposed_masters_late_write_is_refused():
    reg = founded(["a", "b", "c"])
    first = classic("a", ["a", "b", "c"], 1)
    assert reg.apply(write_txn(KEY, first, None, ())).ok  # the founder's put under view 1
    assert reg.apply(propose_txn(GROUP, ProposeView(expected_version=1, members=("b", "c")))).ok
    read = reg.get("amqqueue", KEY)
    assert reg.apply(write_txn(KEY, classic("b", ["b", "c"], 2), read, ())).ok  # an update under view 2
    # a's write, sent while it still held view 1, commits only now: refused
    res = reg.apply(write_txn(KEY, classic("a", ["a", "c"], 1), read, ()))
    assert not res.ok and "gm_group" in res.error and "version is 2" in res.error, res.error
    assert reg.get("amqqueue", KEY)["pid"] == "b" and reg.get("amqqueue", KEY)["gm_pids"] == ["b", "c"]


def test_view_fence_needs_the_view_and_an_update_needs_the_row():
    reg = Registry()  # no gm_group row: a write under view 1 is refused
    res = reg.apply(write_txn(KEY, classic("a", ["a"], 1), None, ()))
    assert not res.ok and "does not exist" in res.error and reg.get("amqqueue", KEY) is None
    assert reg.apply(write_txn(KEY, classic("a", ["a"], None), None, ())).ok  # no view yet: no fence
    reg = founded(["a"])
    res = reg.apply(write_txn(KEY, classic("a", ["a"], 1), {"pid": "a"}, ()))  # read a row the registry lacks
    assert not res.ok and "amqqueue" in res.error, res.error


def test_term_fence_a_put_raced_by_a_newer_leaders_is_refused():
    reg = Registry()
    old = quorum(MEMBERS[0], 3)
    assert reg.apply(write_txn(KEY, old, None, ())).ok  # absent as read: checked absent
    read = reg.get("amqqueue", KEY)
    assert reg.apply(write_txn(KEY, quorum(MEMBERS[1], 4), read, ())).ok
    # the term-3 leader's second put, built on the row it read before: refused
    res = reg.apply(write_txn(KEY, quorum(MEMBERS[0], 3, MEMBERS[:2]), read, ()))
    assert not res.ok and "pid" in res.error, res.error
    # and a put that found no row, when one was put since
    res = reg.apply(write_txn(KEY, quorum(MEMBERS[2], 2), None, ()))
    assert not res.ok and "exists" in res.error, res.error
    assert reg.get("amqqueue", KEY)["pid"] == epoch(MEMBERS[1], 4)


# ---- the core: classic flavour ----------------------------------------------------------------
def test_a_new_master_reads_puts_the_row_and_is_done_without_a_read_back():
    reg = founded(["a", "b"])
    agent = Agent(reg)
    up = RecordUpkeep("a", "agent", KEY)
    want = classic("a", ["a", "b"], 1)
    acts = agent.take(up, up.keep(0.0, want))
    assert acts == [SetTimer(RETRY_TIMER, RECORD_RETRY)]
    assert [type(m) for _u, m in agent.held] == [RegistryGet]
    acts = agent.deliver(0.01)  # absent: a put of the whole row, fenced by view 1
    (txn,) = agent.writes()
    assert txn.txn["ops"][0]["op"] == "put" and txn.txn["checks"][0]["equals"] == 1
    acts = agent.deliver(0.02)
    assert acts == [CancelTimer(RETRY_TIMER), Emit(UpkeepDone(dict(want.fields)))]
    assert not agent.held and not up.pending
    assert reg.get("amqqueue", KEY)["pid"] == "a" and reg.get("amqqueue", KEY)["incarnation"] == "i1"


def test_a_row_that_differs_is_updated_and_one_that_shows_it_is_left_alone():
    reg = founded(["a", "b"])
    agent = Agent(reg)
    assert reg.apply(write_txn(KEY, classic("a", ["a", "b"], 1), None, ())).ok
    assert reg.apply(propose_txn(GROUP, ProposeView(1, ("a",)))).ok
    up = RecordUpkeep("a", "agent", KEY)
    agent.take(up, up.keep(1.0, classic("a", ["a"], 2)))
    agent.deliver(1.01)
    (txn,) = agent.writes()
    assert txn.txn["ops"] == [{"op": "update", "table": "amqqueue", "key": list(KEY), "fields": dict(up.wanted.fields)}]
    assert events(agent.drain(1.02), UpkeepDone)
    assert reg.get("amqqueue", KEY)["slave_pids"] == [] and reg.get("amqqueue", KEY)["durable"] is True
    # the same want again: the read shows it, nothing is written
    agent.take(up, up.keep(2.0, classic("a", ["a"], 2)))
    acts = agent.deliver(2.01)
    assert events(acts, UpkeepDone) and not agent.held


def test_a_deposed_masters_late_write_is_refused_and_its_successors_row_stays():
    reg = founded(["a", "b", "c"])
    agent = Agent(reg)
    assert reg.apply(write_txn(KEY, classic("a", ["a", "b", "c"], 1), None, ())).ok
    a = RecordUpkeep("a", "agent", KEY)
    agent.take(a, a.keep(0.0, classic("a", ["a", "b"], 1)))  # a, in view 1, drops c
    agent.deliver(0.01, up=a)  # a's update is on its way ...
    # ... when a new view (without a) is installed and b, promoted, writes its record
    assert reg.apply(propose_txn(GROUP, ProposeView(1, ("b", "c")))).ok
    b = RecordUpkeep("b", "agent", KEY)
    agent.take(b, b.keep(0.02, classic("b", ["b", "c"], 2)))
    agent.deliver(0.03, up=b)
    agent.deliver(0.04, RegistryTxn, up=b)
    acts = agent.deliver(0.05, RegistryTxn, up=a)  # a's write commits only now
    assert len(events(acts, WriteRefused)) == 1 and "version is 2" in events(acts, WriteRefused)[0].error
    assert reg.get("amqqueue", KEY)["pid"] == "b" and reg.get("amqqueue", KEY)["gm_pids"] == ["b", "c"]
    # a, still master in its own eyes, reads again on its timer and writes again: refused again
    agent.take(a, a.timer(RECORD_RETRY, RETRY_TIMER))
    agent.drain(RECORD_RETRY + 0.01)
    assert reg.get("amqqueue", KEY)["pid"] == "b"
    # a learns it is deposed: nothing more is read or written, its timer is cancelled
    assert a.release(1.0) == [CancelTimer(RETRY_TIMER)]
    assert a.timer(2.0, RETRY_TIMER) == []


def test_reads_back_off_doubling_to_the_bound_while_the_registry_does_not_show_the_row():
    up = RecordUpkeep("a", "agent", KEY)
    up.keep(0.0, classic("a", ["a"], None))
    delays, now = [RECORD_RETRY], 0.0
    for _ in range(8):  # nothing answers: each firing reads and re-arms, twice as late
        now += delays[-1]
        acts = up.timer(now, RETRY_TIMER)
        assert [type(a.msg) for a in acts if isinstance(a, Send)] == [RegistryGet]
        delays += [a.delay for a in acts if isinstance(a, SetTimer)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0] and RECORD_RETRY_MAX == 8.0
    # a new want starts the backoff again; a second keep arms no second timer chain
    acts = up.keep(now, classic("a", ["a"], None))
    assert not [a for a in acts if isinstance(a, SetTimer)]
    acts = up.timer(now + 8.0, RETRY_TIMER)
    assert [a.delay for a in acts if isinstance(a, SetTimer)] == [RECORD_RETRY]


def test_a_write_in_flight_is_not_repeated_within_the_retry_but_a_refused_one_is_at_once():
    reg = founded(["a"])
    agent = Agent(reg)
    up = RecordUpkeep("a", "agent", KEY)
    agent.take(up, up.keep(0.0, classic("a", ["a"], 1)))
    agent.deliver(0.01)  # the put goes out, unanswered for now
    agent.take(up, up.timer(0.2, RETRY_TIMER))  # a read within the retry that does not show it yet
    agent.deliver(0.2, RegistryGet)
    (write,) = agent.writes()  # no second write
    agent.held.clear()
    agent.take(up, up.receive(0.3, "agent", RegistryResult(False, "no registry leader", ref=write.ref)))
    agent.take(up, up.timer(0.4, RETRY_TIMER))
    agent.deliver(0.4, RegistryGet)
    assert len(agent.writes()) == 1  # refused: written again at the next read


def test_answers_of_another_owner_or_after_release_change_nothing():
    reg = founded(["a"])
    agent = Agent(reg)
    up = RecordUpkeep("a", "agent", KEY)
    agent.take(up, up.keep(0.0, classic("a", ["a"], 1)))
    _u, get = agent.held[0]
    other = RegistryRows(True, [], ref=type(get.ref)("someone else"))
    assert up.receive(0.01, "agent", other) == []
    up.release(0.02)
    assert agent.drain(0.03) == [] and reg.get("amqqueue", KEY) is None


# ---- the core: quorum flavour ---------------------------------------------------------------------
def test_a_leader_puts_the_whole_row_checked_against_what_it_read():
    reg = Registry()
    agent = Agent(reg)
    up = RecordUpkeep(MEMBERS[0], "agent", KEY)
    agent.take(up, up.keep(0.0, quorum(MEMBERS[0], 1)))
    agent.deliver(0.01)
    (txn,) = agent.writes()
    assert txn.txn["checks"] == [{"table": "amqqueue", "key": list(KEY), "absent": True}]
    assert events(agent.drain(0.02), UpkeepDone)
    assert reg.get("amqqueue", KEY)["pid"] == epoch(MEMBERS[0], 1)
    # a later leader over a row of an older term: put, checked against the pid it read
    nxt = RecordUpkeep(MEMBERS[1], "agent", KEY)
    agent.take(nxt, nxt.keep(1.0, quorum(MEMBERS[1], 2)))
    agent.deliver(1.01)
    (txn,) = agent.writes()
    assert txn.txn["checks"] == [
        {"table": "amqqueue", "key": list(KEY), "field": "pid", "equals": epoch(MEMBERS[0], 1)}
    ]
    assert txn.txn["ops"][0]["op"] == "put" and txn.txn["ops"][0]["record"]["bootstrap"] == MEMBERS
    agent.drain(1.02)
    assert reg.get("amqqueue", KEY)["pid"] == epoch(MEMBERS[1], 2)


def test_a_row_of_a_higher_term_is_never_written_over():
    reg = Registry()
    assert reg.apply(write_txn(KEY, quorum(MEMBERS[1], 5), None, ())).ok
    agent = Agent(reg)
    old = RecordUpkeep(MEMBERS[0], "agent", KEY)  # a leader of term 4 that does not know it is deposed
    agent.take(old, old.keep(0.0, quorum(MEMBERS[0], 4)))
    acts = agent.deliver(0.01)
    assert events(acts, Superseded) == [Superseded(epoch(MEMBERS[1], 5))]
    assert CancelTimer(RETRY_TIMER) in acts and not agent.held and not old.pending
    assert old.timer(1.0, RETRY_TIMER) == []
    assert reg.get("amqqueue", KEY)["pid"] == epoch(MEMBERS[1], 5)


def test_a_deposed_leaders_late_put_is_refused_then_it_sees_the_newer_term_and_stops():
    reg = Registry()
    assert reg.apply(write_txn(KEY, quorum(MEMBERS[0], 1), None, ())).ok
    agent = Agent(reg)
    old = RecordUpkeep(MEMBERS[0], "agent", KEY)
    new = RecordUpkeep(MEMBERS[1], "agent", KEY)
    agent.take(old, old.keep(0.0, quorum(MEMBERS[0], 1, MEMBERS[:2])))  # term 1 drops c ...
    agent.deliver(0.01, up=old)  # ... read, put built
    agent.take(new, new.keep(0.02, quorum(MEMBERS[1], 2)))  # meanwhile term 2's leader
    agent.deliver(0.03, up=new)
    agent.deliver(0.04, RegistryTxn, up=new)
    acts = agent.deliver(0.05, RegistryTxn, up=old)  # term 1's put lands late: refused
    assert len(events(acts, WriteRefused)) == 1
    assert reg.get("amqqueue", KEY)["pid"] == epoch(MEMBERS[1], 2)
    assert reg.get("amqqueue", KEY)["members"] == MEMBERS
    agent.take(old, old.timer(0.5, RETRY_TIMER))
    acts = agent.drain(0.51)
    assert events(acts, Superseded) and reg.get("amqqueue", KEY)["pid"] == epoch(MEMBERS[1], 2)


def test_member_row_deletes_ride_every_write_until_one_commits_and_only_then():
    reg = Registry()
    for m in MEMBERS:
        assert reg.apply({"ops": [member_row_put(GROUP, m, m[0], f"{m[0]}/h:1/x")]}).ok
    agent = Agent(reg)
    up = RecordUpkeep(MEMBERS[0], "agent", KEY)
    want = quorum(MEMBERS[0], 2, MEMBERS[:2], gone=(MEMBERS[2],))
    gone = RowKey(MEMBER_TABLE, (GROUP, MEMBERS[2]))
    # the registry shows the wanted fields already (the dead leader wrote them) but
    # not that the rows went: the upkeep writes
    assert reg.apply(write_txn(KEY, want, None, ())).ok
    agent.take(up, up.keep(0.0, want))
    agent.deliver(0.01)
    (txn,) = agent.writes()
    assert {"op": "delete", "table": MEMBER_TABLE, "key": [GROUP, MEMBERS[2]]} in txn.txn["ops"]
    acts = agent.drain(0.02)
    assert events(acts, RowsDeleted) == [RowsDeleted((gone,))] and events(acts, UpkeepDone)
    assert reg.get(MEMBER_TABLE, [GROUP, MEMBERS[2]]) is None
    # the next want names the same removed member: not deleted again
    agent.take(up, up.keep(1.0, quorum(MEMBERS[0], 2, MEMBERS[:2], gone=(MEMBERS[2],), dst="d2")))
    agent.deliver(1.01)
    (txn,) = agent.writes()
    assert [op["op"] for op in txn.txn["ops"]] == ["put"]
    assert not events(agent.drain(1.02), RowsDeleted)


def test_a_leader_that_removed_itself_writes_the_row_without_a_leader():
    reg = Registry()
    assert reg.apply(write_txn(KEY, quorum(MEMBERS[0], 3), None, ())).ok
    agent = Agent(reg)
    up = RecordUpkeep(MEMBERS[0], "agent", KEY)
    agent.take(up, up.keep(0.0, quorum(None, 3, MEMBERS[1:], dst=None)))
    assert events(agent.drain(0.01), UpkeepDone)
    row = reg.get("amqqueue", KEY)
    assert row["pid"] is None and row["leader_dst"] is None and row["members"] == MEMBERS[1:]


def test_the_shell_driver_posts_sends_numbers_wakeups_and_hands_back_events():
    from mirrorq.queues.record_upkeep import UpkeepDriver
    from mirrorq.sansio import CancelTimer, Emit, Send, SetTimer

    posted, wakeups = [], []
    d = UpkeepDriver(lambda dst, msg: posted.append((dst, msg)), lambda delay, token: wakeups.append((delay, token)))
    done = UpkeepDone({"pid": "m"})
    events = d.carry_out([Send("agent", "read"), SetTimer(RETRY_TIMER, 0.5), Emit(done)])
    assert posted == [("agent", "read")] and wakeups == [(0.5, 1)] and events == [done]
    d.carry_out([SetTimer(RETRY_TIMER, 1.0)])  # re-armed: the first wakeup is stale
    assert wakeups[-1] == (1.0, 2)
    assert not d.fired(1) and d.fired(2) and not d.fired(2)  # a token fires once
    d.carry_out([SetTimer(RETRY_TIMER, 2.0), CancelTimer(RETRY_TIMER)])
    assert not d.fired(3) and not d.fired(None)
