"""Targeted tests of the sans-IO Raft core: bad input, elections and the
lease guard, Figure-8 commit rule, conflict truncation, batching and
pipelining, ReadIndex, membership change, snapshots.  Hand-routed messages
where a precise interleaving matters, the simulator elsewhere."""

from __future__ import annotations

import random

import pytest

from mirrorq.mnesia_like.raft import (
    CANDIDATE,
    COMMAND,
    COMMIT_TIMER,
    ELECTION_TIMER,
    FOLLOWER,
    HEARTBEAT_TIMER,
    LEADER,
    NOOP,
    QUORUM_TIMER,
    AppendEntries,
    AppendEntriesReply,
    ApplySnapshot,
    Committed,
    Config,
    ConfigChangeRejected,
    Entry,
    InstallSnapshot,
    LeaderChanged,
    MembershipCommitted,
    MemoryRaftLog,
    MessageIgnored,
    NotLeader,
    ProposalAccepted,
    ProposalCommitted,
    ProposalLost,
    RaftNode,
    ReadReady,
    RequestVote,
    RequestVoteReply,
)
from mirrorq.sansio import Emit, Persist, Send, SetTimer
from mirrorq.simulator import Simulator

V3 = ("n1", "n2", "n3")


def mk(name, voters=V3, log=None, now=0.0, **kw):
    node = RaftNode(name, log if log is not None else MemoryRaftLog({}), random.Random(name), voters=voters, **kw)
    node.start(now)
    return node


def sends(actions, dst=None, kind=None):
    return [
        a.msg
        for a in actions
        if type(a) is Send and (dst is None or a.dst == dst) and (kind is None or type(a.msg) is kind)
    ]


def events(actions, kind=None):
    return [a.event for a in actions if type(a) is Emit and (kind is None or type(a.event) is kind)]


def deliver_all(nodes, actions_by_src, now, rounds=20):
    """Route Send actions between the given nodes until quiet (a test
    helper: every message delivered once, in order)."""
    pending = list(actions_by_src)
    for _ in range(rounds):
        nxt = []
        for src, actions in pending:
            for a in actions:
                if type(a) is Send and a.dst in nodes:
                    nxt.append((a.dst, nodes[a.dst].receive(now, src, a.msg)))
        if not nxt:
            return
        pending = nxt


def elect(nodes, name, now=1.0):
    """Make ``name`` campaign (pre-vote off) and deliver everything."""
    out = nodes[name].timer(now, ELECTION_TIMER)
    deliver_all(nodes, [(name, out)], now)
    assert nodes[name].role == LEADER


def cluster(names=V3, **kw):
    return {n: mk(n, names, pre_vote=False, **kw) for n in names}


# ---- bad input -------------------------------------------------------------
def test_constructor_rejects_bad_arguments():
    log = MemoryRaftLog({})
    with pytest.raises(TypeError, match="node_id"):
        RaftNode("", log, random.Random(), voters=V3)
    with pytest.raises(TypeError, match="random.Random"):
        RaftNode("n1", log, None, voters=V3)
    with pytest.raises(TypeError, match="RaftLog"):
        RaftNode("n1", {}, random.Random(), voters=V3)
    with pytest.raises(ValueError, match="election_timeout"):
        RaftNode("n1", log, random.Random(), voters=V3, election_timeout=(0.3, 0.1))
    with pytest.raises(ValueError, match="heartbeat_interval"):
        RaftNode("n1", log, random.Random(), voters=V3, heartbeat_interval=0.5)
    with pytest.raises(ValueError, match="voters"):
        RaftNode("n1", log, random.Random(), voters=())


def test_entry_points_misuse():
    raw = RaftNode("n1", MemoryRaftLog({}), random.Random(), voters=V3)
    with pytest.raises(RuntimeError, match="start"):
        raw.propose(0.0, "x")
    n = mk("n1")
    with pytest.raises(ValueError, match="unknown timer"):
        n.timer(0.0, "bogus")
    with pytest.raises(ValueError, match="applied index"):
        n.compact(0.0, 5, b"state")
    with pytest.raises(TypeError, match="pairs"):
        n.propose_batch(0.0, ["not-a-pair"])
    with pytest.raises(TypeError, match="add_server"):
        n.add_server(0.0, 42)
    with pytest.raises(RuntimeError, match="already started"):
        n.start(0.0)


def test_propose_on_follower_gets_not_leader_with_hint():
    nodes = cluster()
    assert events(nodes["n2"].propose(0.5, "x", pid=7), NotLeader) == [NotLeader(7, None)]
    elect(nodes, "n1")
    out = nodes["n2"].propose(1.1, "y", pid=8)
    assert events(out) == [NotLeader(8, "n1")]
    assert not sends(out)
    assert events(nodes["n3"].read_index(1.1, "r"), NotLeader) == [NotLeader("r", "n1")]
    assert events(nodes["n3"].add_server(1.1, "n4", "a"), NotLeader) == [NotLeader("a", "n1")]


@pytest.mark.parametrize(
    "msg, reason",
    [
        ("garbage", "not a raft message"),
        (AppendEntries(1, "n3", 0, 0, (), 0, 0), "not the sender"),
        (AppendEntries(-1, "n2", 0, 0, (), 0, 0), "term"),
        (AppendEntries(1, "n2", 0, 0, (Entry(2, 1, COMMAND, "x"),), 0, 0), "out of sequence"),
        (AppendEntries(1, "n2", 0, 0, (Entry(1, 5, COMMAND, "x"),), 0, 0), "out of sequence"),
        (AppendEntries(1, "n2", 0, 0, [Entry(1, 1, COMMAND, "x")], 0, 0), "tuple"),
        (AppendEntries(1, "n2", 0, 0, (Entry(1, 1, 2, "not a config"),), 0, 0), "Config"),
        (RequestVote(1, "n3", 0, 0), "not the sender"),
        (RequestVote(1, "n2", -4, 0), "last log"),
        (AppendEntriesReply(1, True, 1.5, 0, 0), "index"),
        (InstallSnapshot(1, "n2", 3, 1, "not a config", 0, 4, b"blob", 0), "bad snapshot"),
        (InstallSnapshot(1, "n2", 3, 1, Config(("n1", "n2")), 2, 4, b"blob", 0), "bad chunk"),
    ],
)
def test_malformed_messages_are_ignored_with_a_reason(msg, reason):
    n = mk("n1")
    before = (n.term, n.role, n.last_index)
    out = n.receive(0.1, "n2", msg)
    ignored = events(out, MessageIgnored)
    assert len(ignored) == 1 and ignored[0].src == "n2" and reason in ignored[0].reason
    assert not sends(out)
    assert (n.term, n.role, n.last_index) == before


# ---- elections ----------------------------------------------------------------
def test_single_server_elects_itself_commits_and_reads():
    n = mk("solo", voters=("solo",))
    out = n.timer(0.3, ELECTION_TIMER)
    assert n.role == LEADER and n.term == 1
    assert events(out, LeaderChanged) == [LeaderChanged(1, "solo")]
    out = n.propose(0.4, "cmd", pid="p")
    assert events(out) == [ProposalAccepted("p", 2, 1), Committed(2, 1, "cmd"), ProposalCommitted("p", 2, 1)]
    assert events(n.read_index(0.5, "r")) == [ReadReady("r", 2)]


def test_vote_once_per_term_and_only_for_up_to_date_logs():
    nodes = cluster()
    n3 = nodes["n3"]
    out = n3.receive(1.0, "n1", RequestVote(1, "n1", 0, 0))
    assert sends(out, "n1") == [RequestVoteReply(1, True)]
    out = n3.receive(1.0, "n2", RequestVote(1, "n2", 0, 0))
    assert sends(out, "n2") == [RequestVoteReply(1, False)]
    assert n3.log.voted_for == "n1"
    # n3 gets an entry of term 2; a candidate with an older last term is refused
    n3.receive(1.1, "n1", AppendEntries(2, "n1", 0, 0, (Entry(1, 2, NOOP, None),), 0, 1))
    out = n3.receive(2.0, "n2", RequestVote(3, "n2", 5, 1))
    assert sends(out, "n2") == [RequestVoteReply(3, False)]
    assert n3.term == 3  # adopted the term (no live leader any more) but no vote


def test_lease_guard_refuses_votes_while_the_leader_is_alive():
    nodes = cluster()
    elect(nodes, "n1", now=1.0)
    n2 = nodes["n2"]
    term = n2.term
    # a disruptive server (e.g. a removed one) asks for votes at a higher term
    out = n2.receive(1.05, "n3", RequestVote(term + 5, "n3", 99, 99))
    assert sends(out, "n3") == [RequestVoteReply(term, False)]
    assert n2.term == term and n2.leader_id == "n1"
    pre = n2.receive(1.05, "n3", RequestVote(term + 1, "n3", 99, 99, pre_vote=True))
    assert sends(pre, "n3") == [RequestVoteReply(term, False, True)]
    # once the leader has been silent for the minimum election timeout, it votes
    later = 1.0 + n2.election_min + 0.01
    out = n2.receive(later, "n3", RequestVote(term + 5, "n3", 99, 99))
    assert sends(out, "n3") == [RequestVoteReply(term + 5, True)]


def test_pre_vote_does_not_raise_terms():
    n1, n2 = mk("n1"), mk("n2")
    out = n1.timer(1.0, ELECTION_TIMER)
    assert n1.term == 0 and n1.role != LEADER
    rv = sends(out, "n2")[0]
    assert rv.pre_vote and rv.term == 1
    reply = n2.receive(1.0, "n1", rv)
    assert n2.term == 0 and n2.log.voted_for is None
    out = n1.receive(1.0, "n2", sends(reply, "n1")[0])
    # pre-vote majority (n1, n2): only now does n1 raise its term and ask for real votes
    assert n1.term == 1 and n1.role == CANDIDATE and n1.log.voted_for == "n1"
    real = sends(out, "n2", RequestVote)
    assert real and not real[0].pre_vote and real[0].term == 1


def test_figure8_leader_does_not_commit_old_term_entries_by_counting():
    """Raft paper Figure 8: s1 (term 4) replicates its term-2 entry to a
    majority; that must NOT commit it, because s5 (last term 3) can still be
    elected and overwrite it."""
    names = ("s1", "s2", "s3", "s4", "s5")
    logs = {n: MemoryRaftLog({}) for n in names}
    e1 = Entry(1, 1, COMMAND, "a")
    for n in names:
        logs[n].append([e1])
    logs["s1"].append([Entry(2, 2, COMMAND, "b")])
    logs["s2"].append([Entry(2, 2, COMMAND, "b")])
    logs["s5"].append([Entry(2, 3, COMMAND, "c")])
    for n, term in zip(names, (3, 3, 3, 3, 3)):
        logs[n].set_hard_state(term, None)
    nodes = {n: mk(n, names, logs[n], pre_vote=False, max_entries_per_message=1) for n in names}
    s1 = nodes["s1"]
    # s1 wins term 4 with s2, s3; s4/s5 unreachable
    out = s1.timer(1.0, ELECTION_TIMER)
    for v in ("s2", "s3"):
        for m in sends(out, v):
            s1.receive(1.0, v, sends(nodes[v].receive(1.0, "s1", m), "s1")[0])
    assert s1.role == LEADER and s1.term == 4
    # replicate one entry per message to s2, s3 only: index 2 (term 2) reaches them first
    committed = []
    for _ in range(6):
        for v in ("s2", "s3"):
            p = s1._peers[v]
            ev = []
            for m in [
                AppendEntries(
                    4,
                    "s1",
                    p.next - 1,
                    s1.log.term_at(p.next - 1),
                    s1.log.entries(p.next, p.next + 1) if p.next <= 2 else (),
                    s1.commit_index,
                    0,
                )
            ]:
                reply = sends(nodes[v].receive(1.1, "s1", m), "s1")[0]
                ev = s1.receive(1.1, v, reply)
            committed += events(ev, Committed)
        if all(nodes[v].log.term_at(2) == 2 for v in ("s2", "s3")) and s1._peers["s3"].match >= 2:
            break
    assert s1._peers["s2"].match == 2 and s1._peers["s3"].match == 2
    assert s1.commit_index == 0 and committed == []  # index 2 is on 3 of 5, but not of term 4
    # s1 dies; s5 (last entry term 3) is elected by s2, s3, s4 and overwrites index 2
    nodes.pop("s1")
    s5 = nodes["s5"]
    for t in (2.0, 2.5):  # term 4 is taken (s2, s3 voted for s1); term 5 succeeds
        deliver_all(nodes, [("s5", s5.timer(t, ELECTION_TIMER))], t)
    assert s5.role == LEADER and s5.term == 5
    deliver_all(nodes, [("s5", s5.propose(2.1, "d"))], 2.1)
    for v in ("s2", "s3", "s4"):
        assert nodes[v].log.entry(2) == Entry(2, 3, COMMAND, "c")
    assert s5.commit_index >= 3


# ---- replication ----------------------------------------------------------------
def test_conflicting_follower_suffix_is_truncated_with_a_term_hint():
    nodes = cluster()
    stale = nodes["n3"].log
    stale.set_hard_state(1, None)
    stale.append([Entry(1, 1, COMMAND, "old1"), Entry(2, 1, COMMAND, "old2"), Entry(3, 1, COMMAND, "old3")])
    n3 = mk("n3", log=stale, pre_vote=False)
    nodes["n3"] = n3
    nodes["n1"].log.set_hard_state(1, None)
    nodes["n1"].log.append([Entry(1, 1, COMMAND, "old1")])
    nodes["n1"] = mk("n1", log=nodes["n1"].log, pre_vote=False)
    n1 = nodes["n1"]
    out = n1.timer(1.0, ELECTION_TIMER)
    rv_reply = sends(nodes["n2"].receive(1.0, "n1", sends(out, "n2")[0]), "n1")[0]
    out = n1.receive(1.0, "n2", rv_reply)
    assert n1.role == LEADER  # log [1@1, 2@2(noop)]
    ae = sends(out, "n3", AppendEntries)[0]
    assert (ae.prev_index, ae.prev_term) == (1, 1)
    reply = sends(n3.receive(1.0, "n1", ae), "n1")[0]
    assert reply.success and reply.index == 2
    assert [e.data for e in n3.log.entries(1, 3)] == ["old1", None] and n3.last_index == 2
    # a term conflict at prev is refused with the first index of that term
    n3.log.append([Entry(3, 1, COMMAND, "x")])  # pretend an old entry at 3
    reply = sends(n3.receive(1.2, "n1", AppendEntries(n1.term, "n1", 3, n1.term, (), 0, 2)), "n1")[0]
    assert not reply.success and reply.index == 3 and reply.hint == 3


def test_batching_caps_entries_per_message_and_persists_once_per_call():
    class CountingLog(MemoryRaftLog):
        flushes = 0

        def flush(self):
            CountingLog.flushes += 1

    nodes = cluster()
    elect(nodes, "n1")
    n1 = nodes["n1"]
    start = n1.last_index
    CountingLog.flushes = 0
    n1.log.__class__ = CountingLog
    out = n1.propose_batch(2.0, [(i, f"c{i}") for i in range(1200)])
    assert CountingLog.flushes == 0  # the core does not flush: it asks its driver to (Persist)
    assert sum(isinstance(a, Persist) for a in out) == 1
    n1.persist(2.0)
    assert CountingLog.flushes == 1
    msgs = sends(out, "n2", AppendEntries)
    assert [len(m.entries) for m in msgs] == [512, 512, 176]
    assert [m.prev_index for m in msgs] == [start, start + 512, start + 1024]
    # pipelining: a further proposal goes out before any reply arrived
    more = sends(n1.propose(2.0, "late"), "n2", AppendEntries)
    assert len(more) == 1 and more[0].prev_index == start + 1200 and len(more[0].entries) == 1
    # and all of it commits once replies come back
    deliver_all(nodes, [("n1", out), ("n1", n1.propose(2.0, "z"))], 2.1)
    assert n1.commit_index == n1.last_index == start + 1202


def test_early_appends_leave_before_the_leaders_persist_and_count_it_only_once_durable():
    nodes = cluster(early_appends=True)
    elect(nodes, "n1")
    n1, n2, n3 = nodes["n1"], nodes["n2"], nodes["n3"]
    # its new term is not durable yet: nothing it sends may leave before its Persist
    out = n1.propose(1.1, "a", pid="a")
    assert [a.early for a in out if type(a) is Send] == [False, False]
    assert type(out[-1]) is Persist
    deliver_all(nodes, [("n1", out)], 1.1)
    assert n1.commit_index == n1.last_index  # the followers' copies: a majority without the leader's
    n1.persisted(1.1)
    start = n1.last_index
    # term durable: its appends may leave before the Persist that ends the turn
    out = n1.propose(1.2, "b", pid="b")
    appends = [a for a in out if type(a) is Send and type(a.msg) is AppendEntries]
    assert len(appends) == 2 and all(a.early for a in appends)
    assert out.index(appends[-1]) < out.index(Persist())
    # a follower's acknowledgement claims the entry on disk: it waits for the follower's Persist
    n3.receive(1.2, "n1", appends[1].msg)  # (its acknowledgement is lost)
    reply = n2.receive(1.2, "n1", appends[0].msg)
    acks = [a for a in reply if type(a) is Send]
    assert len(acks) == 1 and not acks[0].early and type(reply[-1]) is Persist
    # one follower's copy and the leader's unpersisted one are no majority
    assert events(n1.receive(1.3, "n2", acks[0].msg), Committed) == []
    assert n1.commit_index == start
    # the leader's persist counts its copy: committed, and the followers told at once (early too)
    done = n1.persisted(1.3)
    assert events(done, Committed) == [Committed(start + 1, n1.term, "b")]
    assert n1.commit_index == start + 1
    told = [a for a in done if type(a) is Send and type(a.msg) is AppendEntries]
    assert told and all(a.early and a.msg.commit == start + 1 for a in told)
    # or two followers' copies, without the leader's
    out = n1.propose(1.4, "c", pid="c")
    appends = {a.dst: a.msg for a in out if type(a) is Send and type(a.msg) is AppendEntries}
    for peer in ("n2", "n3"):
        for a in nodes[peer].receive(1.4, "n1", appends[peer]):
            if type(a) is Send:
                n1.receive(1.5, peer, a.msg)
    assert n1.commit_index == start + 2 and n1.log.last_index == start + 2


def test_early_appends_a_lone_voter_commits_when_its_driver_persisted():
    n = mk("solo", voters=("solo",), early_appends=True)
    n.timer(0.3, ELECTION_TIMER)
    assert n.role == LEADER
    out = n.propose(0.4, "cmd", pid="p")
    assert events(out) == [ProposalAccepted("p", 2, 1)] and n.commit_index == 0
    done = n.persist(0.4)
    assert events(done) == [Committed(2, 1, "cmd"), ProposalCommitted("p", 2, 1)]


def test_the_in_flight_window_bounds_unacknowledged_appends_per_follower():
    nodes = cluster(max_inflight=2)
    elect(nodes, "n1")
    n1, n2 = nodes["n1"], nodes["n2"]
    start = n1.last_index
    out = []
    for i in range(5):  # five turns, one entry each: pipelined, but two messages at most in flight
        out += n1.propose(2.0, f"c{i}")
    to_n2 = sends(out, "n2", AppendEntries)
    assert [m.prev_index for m in to_n2] == [start, start + 1]
    # an acknowledgement of the first opens the window by one
    reply = sends(n2.receive(2.1, "n1", to_n2[0]), "n1")[0]
    more = [m for m in sends(n1.receive(2.1, "n2", reply), "n2", AppendEntries) if m.entries]
    assert [(m.prev_index, len(m.entries)) for m in more] == [(start + 2, 3)]  # all that waited, in one
    # no progress for a heartbeat interval: what is in flight is resent, the window starts over
    hb = sends(n1.timer(2.1 + 2 * n1.heartbeat_interval, HEARTBEAT_TIMER), "n2", AppendEntries)
    assert [(m.prev_index, len(m.entries)) for m in hb] == [(start + 1, 4)]
    # by bytes too: a message starts only while the follower is under max_inflight_bytes
    nodes = cluster(max_inflight_bytes=1)
    elect(nodes, "n1")
    n1 = nodes["n1"]
    start = n1.last_index
    out = n1.propose(3.0, "a") + n1.propose(3.0, "b")
    assert [m.prev_index for m in sends(out, "n2", AppendEntries)] == [start]


def test_a_commit_notice_delay_lets_the_next_append_tell_followers():
    nodes = cluster(commit_notice_delay=0.02)
    elect(nodes, "n1")
    n1, n2 = nodes["n1"], nodes["n2"]
    n1.timer(1.5, COMMIT_TIMER)  # (the election's notice)
    out = n1.propose(2.0, "a")
    msg = sends(out, "n2", AppendEntries)[0]
    acked = n1.receive(2.01, "n2", sends(n2.receive(2.01, "n1", msg), "n1")[0])
    assert n1.commit_index == msg.prev_index + 1
    assert sends(acked) == [] and SetTimer(COMMIT_TIMER, 0.02) in acked  # no notice yet
    # the next append carries the commit: the timer finds the follower told
    nxt = sends(n1.propose(2.015, "b"), "n2", AppendEntries)[0]
    assert nxt.commit == n1.commit_index
    assert [m for m in sends(n1.timer(2.03, COMMIT_TIMER), "n2")] == []
    # nothing more comes: the timer tells
    acked = n1.receive(2.04, "n2", sends(n2.receive(2.04, "n1", nxt), "n1")[0])
    assert sends(acked, "n2") == []
    told = sends(n1.timer(2.06, COMMIT_TIMER), "n2", AppendEntries)
    assert [(m.entries, m.commit) for m in told] == [((), n1.commit_index)]


def test_lost_proposal_is_reported_when_another_entry_wins_its_index():
    nodes = cluster()
    elect(nodes, "n1")
    n1 = nodes["n1"]
    out = n1.propose(2.0, "doomed", pid="p1")  # never delivered
    (acc,) = events(out, ProposalAccepted)
    # n2 takes over (n1 partitioned); its entries overwrite index acc.index
    rest = {k: v for k, v in nodes.items() if k != "n1"}
    later = 2.0 + nodes["n2"].election_min + 0.1
    deliver_all(rest, [("n2", nodes["n2"].timer(later, ELECTION_TIMER))], later)
    deliver_all(rest, [("n2", nodes["n2"].propose(later, "winner"))], later)
    # n1 hears from the new leader and applies the winning entry at that index
    hb = AppendEntries(
        nodes["n2"].term,
        "n2",
        0,
        0,
        nodes["n2"].log.entries(1, nodes["n2"].last_index + 1),
        nodes["n2"].commit_index,
        9,
    )
    ev = events(n1.receive(later + 0.01, "n2", hb))
    assert ProposalLost("p1", acc.index, acc.term) in ev
    assert not any(type(e) is ProposalCommitted for e in ev)


# ---- ReadIndex ------------------------------------------------------------------
def test_read_index_waits_for_a_heartbeat_quorum():
    nodes = cluster()
    elect(nodes, "n1")
    n1 = nodes["n1"]
    out = n1.read_index(2.0, "r1")
    assert events(out) == []
    hbs = [(d, m) for d in ("n2", "n3") for m in sends(out, d)]
    assert hbs and all(type(m) is AppendEntries for _, m in hbs)
    d, m = hbs[0]
    ev = events(n1.receive(2.0, d, sends(nodes[d].receive(2.0, "n1", m), "n1")[0]))
    assert ev == [ReadReady("r1", n1.commit_index)]


def test_read_index_is_deferred_until_leader_commits_in_its_term_and_fails_on_step_down():
    nodes = cluster()
    n1 = nodes["n1"]
    out = n1.timer(1.0, ELECTION_TIMER)
    reply = sends(nodes["n2"].receive(1.0, "n1", sends(out, "n2")[0]), "n1")[0]
    n1.receive(1.0, "n2", reply)
    assert n1.role == LEADER and n1.commit_index == 0  # noop not yet acknowledged
    assert events(n1.read_index(1.0, "early")) == []
    # a higher term deposes it: the pending read fails with NotLeader
    out = n1.receive(1.1, "n3", AppendEntries(n1.term + 1, "n3", 0, 0, (), 0, 0))
    assert n1.role == FOLLOWER
    assert NotLeader("early", "n3") in events(out)


# ---- membership & snapshots (simulated) -------------------------------------------
class App:
    """Minimal application: state = list of (index, command); snapshots
    every ``snap_every`` entries."""

    def __init__(self, name, disk, sim, voters, snap_every=10, **kw):
        self.state = {}
        self.raft = RaftNode(name, MemoryRaftLog(disk), random.Random(sim.rng.getrandbits(64)), voters=voters, **kw)
        self.snap_every = snap_every

    def _obs(self, now, actions):
        for ev in events(actions):
            if type(ev) is Committed:
                self.state[ev.index] = ev.command
            elif type(ev) is ApplySnapshot:
                self.state = dict(ev.data)
        r = self.raft
        if r.applied_index - r.log.snapshot_index >= self.snap_every:
            r.compact(now, r.applied_index, tuple(sorted(self.state.items())))
        return actions

    def persist(self, now):
        self.raft.persist(now)

    def start(self, now):
        return self._obs(now, self.raft.start(now))

    def receive(self, now, src, msg):
        return self._obs(now, self.raft.receive(now, src, msg))

    def timer(self, now, key):
        return self._obs(now, self.raft.timer(now, key))

    def propose(self, now, command):
        return self._obs(now, self.raft.propose(now, command))

    def add_server(self, now, node, rid):
        return self._obs(now, self.raft.add_server(now, node, rid))

    def remove_server(self, now, node, rid):
        return self._obs(now, self.raft.remove_server(now, node, rid))


def leader(sim):
    ls = [sim.core(n) for n in sim.alive() if sim.core(n).raft.role == LEADER]
    return max(ls, key=lambda a: a.raft.term) if ls else None


def sim_cluster(seed, names, voters, **kw):
    sim = Simulator(seed)
    for n in names:
        sim.add_node(n, lambda name, disk: App(name, disk, sim, voters, **kw))
    assert sim.run_until(lambda: leader(sim) is not None, 3.0)
    return sim


def test_join_as_learner_then_voter_and_removed_server_cannot_disrupt():
    sim = sim_cluster(3, ("n1", "n2", "n3", "n4"), V3, pre_vote=False)
    ld = leader(sim)
    for i in range(30):
        sim.call(ld.raft.id, "propose", f"c{i}")
    sim.run_for(0.2)
    sim.call(ld.raft.id, "add_server", "n4", "join")
    assert sim.run_until(lambda: any("n4" in e.config.voters for _, _, e in sim.events(kind=MembershipCommitted)), 3)
    configs = [e.config for _, n, e in sim.events(node=ld.raft.id, kind=MembershipCommitted)]
    assert Config(V3, ("n4",)) in configs  # learner first ...
    assert configs[-1] == Config(("n1", "n2", "n3", "n4"))  # ... then voter
    sim.run_for(0.2)  # n4 learns the commit index with the next heartbeat
    assert sim.core("n4").state == sim.core(ld.raft.id).state and len(sim.core("n4").state) == 30
    # a second change while one is pending is refused
    ld = leader(sim)
    sim.call(ld.raft.id, "remove_server", "n3", "rm")
    out = ld.raft.remove_server(sim.now, "n2", "rm2")
    assert events(out) == [ConfigChangeRejected("rm2", "another membership change is not committed yet")]
    assert sim.run_until(lambda: leader(sim) is not None and "n3" not in leader(sim).raft.committed_config.members, 3)
    # n3 no longer hears from anyone; it campaigns (pre-vote off) but cannot disrupt
    term = leader(sim).raft.term
    sim.run_for(3.0)
    assert leader(sim).raft.term == term
    assert sim.core("n3").raft.term > term  # it did try
    sim.call(leader(sim).raft.id, "propose", "after")
    sim.run_for(0.3)
    members = leader(sim).raft.config.members
    assert members == ("n1", "n2", "n4")
    assert all("after" in sim.core(m).state.values() for m in members)


def test_lagging_server_catches_up_through_install_snapshot_and_restart_restores():
    sim = sim_cluster(5, V3, V3, snap_every=10)
    ld = leader(sim).raft.id
    lagger = next(n for n in V3 if n != ld)
    sim.kill(lagger)
    for i in range(60):
        sim.call(ld, "propose", f"c{i}")
        sim.run_for(0.002)
    sim.run_for(0.2)
    assert sim.core(ld).raft.log.snapshot_index >= 50
    sim.start(lagger)
    assert sim.run_until(lambda: sim.core(lagger).raft.applied_index == sim.core(ld).raft.commit_index, 3)
    snaps = [e for _, _, e in sim.events(node=lagger, kind=ApplySnapshot)]
    assert snaps and snaps[-1].index >= 50
    assert sim.core(lagger).state == sim.core(ld).state
    assert sorted(sim.core(ld).state.values()) == sorted(f"c{i}" for i in range(60))
    # a restart hands the stored snapshot back to the application first
    mark = len(sim.emitted)
    sim.restart(ld)
    first = [e for _, n, e in sim.emitted[mark:] if n == ld]
    assert type(first[0]) is ApplySnapshot and first[0].index == sim.core(ld).raft.log.snapshot_index
    assert sim.run_until(lambda: leader(sim) is not None and all(sim.core(n).state == leader(sim).state for n in V3), 3)


def test_leader_lost_hint_drops_the_lease_and_campaigns_soon():
    nodes = cluster()
    elect(nodes, "n1", now=1.0)
    n2, n3 = nodes["n2"], nodes["n3"]
    term = n2.term
    assert n2.leader_lost(1.05, "n3") == [] and n2.leader_id == "n1"  # not its leader: nothing
    out = n2.leader_lost(1.05, "n1")
    timers = [a for a in out if type(a).__name__ == "SetTimer"]
    assert n2.leader_id is None and len(timers) == 1 and timers[0].delay <= n2.lost_leader_delay
    # n3 still hears n1 (no hint): its lease refuses n2, so a wrong hint disrupts nothing
    vote = n2.timer(1.06, ELECTION_TIMER)
    reply = n3.receive(1.06, "n2", sends(vote, "n3")[0])
    assert n3.leader_id == "n1" and not sends(reply, "n2")[0].granted
    # the refused campaign is tried again soon (the dead leader's node is known), not after an election timeout
    rearm = [a for a in vote if type(a).__name__ == "SetTimer" and a.key == ELECTION_TIMER]
    assert rearm and all(a.delay <= n2.lost_leader_delay for a in rearm)
    # once n3 has the hint too, n2 wins at once, long before an election timeout
    n3.leader_lost(1.07, "n1")
    out = n2.timer(1.08, ELECTION_TIMER)
    deliver_all({"n2": n2, "n3": n3}, [("n2", out)], 1.08)
    assert n2.role == LEADER and n2.term > term
    assert nodes["n1"].leader_lost(1.1, "n1") == []  # a node never suspects itself
    # with a leader known again, elections wait a whole timeout again
    n3.leader_lost(1.2, "n2")
    heard = n3.receive(
        1.21,
        "n2",
        AppendEntries(n2.term, "n2", n3.log.last_index, n3.log.term_at(n3.log.last_index), (), n3.commit_index, 99),
    )
    later = [a for a in heard if type(a).__name__ == "SetTimer" and a.key == ELECTION_TIMER]
    assert n3.leader_id == "n2" and later and all(a.delay >= n3.election_min for a in later)


def test_a_leader_that_removed_itself_and_lost_its_leadership_campaigns_until_the_removal_commits():
    """n1 leads {n1, n2}, appends the configuration {n2} (removing itself)
    and loses its leadership before n2 has that entry.  n2 can never win n1's
    vote (n1's log is ahead), so n1, outside its latest configuration but a
    voter of the committed one, must campaign: it wins with n2's vote alone,
    commits the removal and steps down, and then n2 leads alone."""
    nodes = cluster(("n1", "n2"), check_quorum=True)
    elect(nodes, "n1", now=1.0)
    n1, n2 = nodes["n1"], nodes["n2"]
    lost = n1.remove_server(1.1, "n1", "rm")  # never delivered: n2 does not get the new configuration
    assert sends(lost, "n2") and n1.config.voters == ("n2",)
    t = 1.1 + n1.election_max + 0.5
    n1.timer(t, QUORUM_TIMER)  # n2 not heard from: n1 steps down, the change not committed
    assert n1.role != LEADER and n1.commit_index < n1.log.last_index
    out = n2.timer(t, ELECTION_TIMER)  # n2 campaigns with a shorter log: refused
    deliver_all(nodes, [("n2", out)], t)
    assert n2.role != LEADER
    t += n1.election_max + 0.5
    out = n1.timer(t, ELECTION_TIMER)
    assert sends(out, "n2", RequestVote), "the removed but uncommitted member must stand for election"
    deliver_all(nodes, [("n1", out)], t)
    assert n1.commit_index == n1.log.last_index and n1.committed_config.voters == ("n2",)  # the removal committed
    assert n1.role != LEADER and n2.config.voters == ("n2",)  # and n1 stepped down
    t += n2.election_max + 0.5
    deliver_all(nodes, [("n2", n2.timer(t, ELECTION_TIMER))], t)
    assert n2.role == LEADER and n2.commit_index == n2.log.last_index
    t += n1.election_max + 0.5
    assert not sends(n1.timer(t, ELECTION_TIMER), kind=RequestVote)  # committed: n1 never campaigns again
