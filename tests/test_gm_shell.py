"""The GM actor shell without Thespian running: member names and addresses,
the frame codec, the registry transactions (applied to the real registry
state machine), and shells wired to fake actors and a fake node agent that
runs a real :class:`~mirrorq.mnesia_like.registry.Registry`.

The fake wiring is a FIFO queue of sends and a list of requested wakeups that
the test fires when the queue is empty: enough to drive the shell's
translation (frames, timers, views, proposals, callbacks).  The protocol
itself is tested under the simulator (tests/test_gm_sim.py) and on a real
cluster (tests/cluster/test_gm_cluster.py).
"""

from __future__ import annotations

import hashlib
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from thespian.actors import ActorAddress, PoisonMessage, WakeupMessage
from thespian.system.transport.IPBase import TCPv4ActorAddress

from mirrorq.gm.core import Activity, GMMember, Item, Nudge, ProposeView
from mirrorq.gm.messages import GMCodecError, GMFrame, decode, encode
from mirrorq.gm.shell import (
    GMCallbacks,
    GMShell,
    address_host_port,
    create_txn,
    member_address,
    member_name,
    parse_member_name,
    propose_txn,
)
from mirrorq.mnesia_like.registry import Registry
from mirrorq.node.messages import (
    NodeEvent,
    RegistryChanges,
    RegistryGet,
    RegistryResult,
    RegistryRows,
    RegistrySubscribe,
    RegistryTxn,
    Subscribe,
)

# ---- names and addresses ------------------------------------------------------------
node_names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,20}", fullmatch=True)


@settings(max_examples=60, deadline=None)
@given(node=node_names, port=st.integers(1, 65535), uid=st.text("0123456789abcdef", min_size=1, max_size=16))
def test_member_name_round_trips_through_a_thespian_address(node, port, uid):
    name = member_name(node, "127.0.0.1", port, uid)
    ref = parse_member_name(name)
    assert (ref.node, ref.host, ref.port, ref.uid) == (node, "127.0.0.1", port, uid)
    addr = member_address(name)
    assert addr == ActorAddress(TCPv4ActorAddress("127.0.0.1", port))
    assert address_host_port(addr) == ("127.0.0.1", port)


@pytest.mark.parametrize(
    "bad", ["", "node1", "node1/127.0.0.1/x", "node1/127.0.0.1:0/x", "n/h:99999/x", "a/b:1/c/d", 7]
)
def test_bad_member_names_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="member name"):
        parse_member_name(bad)


def test_member_name_parts_are_checked():
    with pytest.raises(ValueError, match="node"):
        member_name("a/b", "127.0.0.1", 1, "u")
    with pytest.raises(ValueError, match="port"):
        member_name("n", "127.0.0.1", 0, "u")


# ---- codec ------------------------------------------------------------------------------
payloads = st.one_of(st.binary(max_size=64), st.text(max_size=8), st.integers(-(2**63), 2**63 - 1))
items = st.builds(
    Item,
    origin=st.sampled_from(["a", "b", "c"]),
    pubs=st.lists(st.tuples(st.integers(1, 10**9), payloads), max_size=5).map(tuple),
    marker=st.none() | st.integers(0, 10**9),
    ack=st.none() | st.integers(0, 10**9),
    full=st.booleans(),
)
core_msgs = st.one_of(
    st.builds(Activity, version=st.integers(1, 10**6), items=st.lists(items, max_size=4).map(tuple)),
    st.builds(Nudge, version=st.integers(1, 10**6)),
)


@settings(max_examples=100, deadline=None)
@given(msgs=st.lists(core_msgs, min_size=1, max_size=4), dst=st.sampled_from(["a", "b", "z"]))
def test_codec_round_trip_leaves_out_only_the_receivers_own_pubs(msgs, dst):
    out = decode(encode(msgs, dst))
    assert len(out) == len(msgs)
    for m, o in zip(msgs, out):
        if isinstance(m, Nudge):
            assert o == m
            continue
        want = tuple(Item(i.origin, () if i.origin == dst else i.pubs, i.marker, i.ack, i.full) for i in m.items)
        assert o == Activity(m.version, want)


@pytest.mark.parametrize("body", [b"\xc1", b"\x01", b"\x91\x93\x07\x01\x90", "text"])
def test_bad_frame_bodies_raise_codec_errors(body):
    with pytest.raises(GMCodecError):
        decode(body)


def test_encode_refuses_what_msgpack_cannot_carry():
    with pytest.raises(TypeError, match="msgpack-friendly"):
        encode([Activity(1, (Item("a", ((1, object()),)),))])
    with pytest.raises(TypeError, match="Activity or Nudge"):
        encode(["hello"])


def test_frame_repr_does_not_dump_the_body():
    f = GMFrame("g", "a", "b", b"x" * 100_000)
    assert len(repr(f)) < 200 and "100000 bytes" in str(f)


# ---- registry transactions --------------------------------------------------------------
def test_view_change_wins_once_per_version():
    reg = Registry()
    assert reg.apply(create_txn("g", ["a", "b", "c"])).ok
    assert not reg.apply(create_txn("g", ["x"])).ok  # the group exists
    assert reg.apply(propose_txn("g", ProposeView(1, ("a", "b")))).ok
    loser = reg.apply(propose_txn("g", ProposeView(1, ("a", "c"))))
    assert not loser.ok and "precondition failed" in loser.error
    assert reg.get("gm_group", "g") == {"name": "g", "version": 2, "members": ["a", "b"]}


# ---- shells on fake actors ----------------------------------------------------------------
AGENT = "agent"


class FakeActor:
    def __init__(self, net: Net, port: int):
        self.net = net
        self.myAddress = ActorAddress(TCPv4ActorAddress("127.0.0.1", port))
        self.wakeups: list = []

    def send(self, addr, msg):
        self.net.queue.append((addr, msg, self.myAddress))

    def wakeupAfter(self, delay, payload=None):
        self.wakeups.append(payload)


class Recorder(GMCallbacks):
    def __init__(self):
        self.delivered: dict[str, list] = {}
        self.confirmed: list[tuple[int, int]] = []
        self.views: list = []
        self.removed = False
        self.on_confirm = None

    def gm_delivered(self, origin, seq, payload):
        self.delivered.setdefault(origin, []).append((seq, payload))

    def gm_confirmed(self, first, last):
        self.confirmed.append((first, last))
        if self.on_confirm:
            self.on_confirm(first, last)

    def gm_members_changed(self, view, births, deaths):
        self.views.append(view)

    def gm_removed(self):
        self.removed = True


class Net:
    """FIFO sends, one fake node agent with a real Registry, wakeups fired
    when nothing is in flight."""

    def __init__(self):
        self.queue: deque = deque()
        self.registry = Registry()
        self.subscribers: list = []
        self.shells: dict = {}  # (host, port) -> shell
        self.dead: set = set()
        self.poison_subscribe = False
        self.txns: list = []
        self.port = 40000

    def shell(self, group="g", node="n1", **kw) -> GMShell:
        self.port += 1
        actor = FakeActor(self, self.port)
        rec = Recorder()
        sh = GMShell(actor, group, rec, agent=AGENT, node=node, send_backoff=None, **kw)
        self.shells[("127.0.0.1", self.port)] = sh
        sh.start()
        return sh

    def _agent(self, msg, sender):
        reply = lambda m: self.queue.append((sender, m, AGENT))  # noqa: E731
        if isinstance(msg, Subscribe):
            return
        if isinstance(msg, RegistrySubscribe):
            if self.poison_subscribe:
                reply(PoisonMessage(msg))
            else:
                self.subscribers.append(sender)
        elif isinstance(msg, RegistryGet):
            row = self.registry.get(msg.table, msg.key)
            reply(RegistryRows(True, [] if row is None else [row], ref=msg.ref))  # the agent echoes refs
        elif isinstance(msg, RegistryTxn):
            self.txns.append(msg.txn)
            res = self.registry.apply(msg.txn)
            reply(RegistryResult(res.ok, res.error, ref=msg.ref))
            if res.ok:
                for s in self.subscribers:
                    self.queue.append(
                        (s, RegistryChanges([(c.table, c.key, c.old, c.new) for c in res.changes]), AGENT)
                    )
        else:
            raise AssertionError(f"fake agent got {msg!r}")

    def settle(self, rounds: int = 200, *, quiet: bool = True) -> None:
        """Deliver everything, fire the wakeups, repeat; ``quiet``: the
        shells must end with nothing in flight and no timer set."""
        for _ in range(rounds):
            while self.queue:
                dst, msg, sender = self.queue.popleft()
                if dst == AGENT:
                    self._agent(msg, sender)
                    continue
                hp = address_host_port(dst)
                if hp in self.dead:
                    continue
                sh = self.shells[hp]
                claimed = sh.handle(msg, sender)
                if isinstance(msg, GMFrame):
                    assert claimed
            fired = False
            for hp, sh in list(self.shells.items()):
                if hp in self.dead:
                    continue
                pending, sh.actor.wakeups = sh.actor.wakeups, []
                for p in pending:
                    fired = True
                    assert sh.handle(WakeupMessage(0, p), None)
            if not fired and not self.queue:
                return
        if quiet:
            raise AssertionError("the fake network did not settle")

    def kill(self, sh: GMShell) -> None:
        self.dead.add(address_host_port(sh.actor.myAddress))


def recs(*shells):
    return [s.callbacks for s in shells]


def payload(i: int) -> bytes:
    return i.to_bytes(8, "big") + hashlib.sha256(str(i).encode()).digest()


def test_founders_join_broadcast_and_a_node_death():
    net = Net()
    a, b = net.shell(node="n1"), net.shell(node="n2")
    a.create([a.name, b.name])
    net.settle()
    assert a.view.version == b.view.version == 1 and a.view.members == (a.name, b.name)
    c = net.shell(node="n3")
    c.join()
    net.settle()
    assert [s.view.members for s in (a, b, c)] == [(a.name, b.name, c.name)] * 3 and a.view.version == 2

    a.broadcast_many(payload(i) for i in range(1, 1001))
    b.broadcast(payload(1))
    net.settle()
    for r in recs(a, b, c):
        assert [s for s, _ in r.delivered[a.name]] == list(range(1, 1001))
        assert r.delivered[b.name] == [(1, payload(1))]
    assert recs(a)[0].confirmed[-1][1] == 1000 and recs(b)[0].confirmed == [(1, 1)]
    # 1000 pubs went round in a handful of frames, not one per pub
    assert a.counters["frames_out"] <= 10

    # node n3 dies: the survivors propose the view without its member
    net.kill(c)
    a.broadcast_many(payload(i) for i in range(1001, 1101))  # stalls: c cannot pass it on
    net.settle(rounds=10, quiet=False)  # a few retransmission ticks
    assert recs(a)[0].confirmed[-1][1] == 1000
    for s in (a, b):
        s.handle(NodeEvent("down", "n3", 1, "timeout"))
    net.settle()
    assert a.view.members == b.view.members == (a.name, b.name) and a.view.version == 3
    assert recs(a)[0].confirmed[-1][1] == 1100
    assert [s for s, _ in recs(b)[0].delivered[a.name]] == list(range(1, 1101))
    assert all(s.member.stats.anomalies == 0 for s in (a, b, c))
    # exactly one of the two concurrent proposals won, against version 2
    props = [t for t in net.txns if t["checks"][0].get("equals") == 2]
    assert props and all(t["ops"][0]["fields"]["members"] == [a.name, b.name] for t in props)


def test_a_member_falsely_reported_dead_learns_it_was_removed():
    net = Net()
    a, b, c = net.shell(node="n1"), net.shell(node="n2"), net.shell(node="n3")
    a.create([a.name, b.name, c.name])
    net.settle()
    a.handle(NodeEvent("down", "n3", 7, "timeout"))  # c is alive, a does not know
    net.settle()
    assert c.removed and recs(c)[0].removed and a.view.members == (a.name, b.name)
    with pytest.raises(Exception, match="removed"):
        c.broadcast(b"late")


def test_up_with_the_same_incarnation_takes_the_suspicion_back():
    net = Net()
    a, b = net.shell(node="n1"), net.shell(node="n2")
    a.create([a.name, b.name])
    net.settle()
    net.poison_subscribe = False
    net.kill(a)  # a's proposals never reach the agent in this test: b alone suspects
    b.handle(NodeEvent("down", "n1", 5))
    assert a.name in b.member.suspected
    b.handle(NodeEvent("up", "n1", 5))
    assert a.name not in b.member.suspected
    b.handle(NodeEvent("down", "n1", 5))
    b.handle(NodeEvent("up", "n1", 6))  # restarted: the old member stays suspected
    assert a.name in b.member.suspected


def test_join_founds_a_missing_group_alone():
    net = Net()
    a = net.shell()
    net.settle()
    a.join()
    net.settle()
    assert a.view is not None and a.view.members == (a.name,)
    a.broadcast(b"x")
    assert recs(a)[0].confirmed == [(1, 1)]


def test_callbacks_may_broadcast_without_reordering_frames():
    net = Net()
    a, b = net.shell(max_batch=3), net.shell(max_batch=3)
    a.create([a.name, b.name])
    net.settle()
    sent = [0]

    def more(first, last):
        if sent[0] < 300:
            a.broadcast_many(payload(sent[0] + i) for i in range(1, 8))
            sent[0] += 7

    recs(a)[0].on_confirm = more
    a.broadcast_many(payload(i) for i in range(1, 8))
    sent[0] = 7
    net.settle()
    got = [s for s, _ in recs(b)[0].delivered[a.name]]
    assert got == list(range(1, sent[0] + 1)) and sent[0] > 300
    assert b.member.stats.gaps == 0 and a.member.stats.retransmits == 0


def test_views_are_polled_when_the_agent_refuses_the_subscription():
    net = Net()
    net.poison_subscribe = True
    a, b = net.shell(), net.shell()
    net.settle(rounds=3, quiet=False)
    assert a.polling and b.polling
    a.create([a.name, b.name])
    net.settle(rounds=5, quiet=False)  # the poll timers keep firing
    assert a.view is not None and b.view is not None and b.view.members == (a.name, b.name)


def test_frames_not_for_this_member_are_not_taken_for_it():
    net = Net()
    a, b = net.shell(), net.shell()
    a.create([a.name, b.name])
    net.settle()
    assert not a.handle(GMFrame("other-group", b.name, a.name, encode([Nudge(1)])))
    assert a.handle(GMFrame("g", b.name, "n1/127.0.0.1:1/old", encode([Nudge(1)])))
    assert a.counters["misrouted"] == 1
    assert a.handle(GMFrame("g", b.name, a.name, b"\xc1"))
    assert a.counters["bad_frames"] == 1 and "not msgpack" in a.last_bad_frame
    assert not a.handle(WakeupMessage(0, "someone else's"))
    assert not a.handle("hello")


def test_a_cancelled_timer_does_not_fire():
    net = Net()
    a, b = net.shell(max_batch=10), net.shell()
    a.create([a.name, b.name])
    net.settle()
    a.broadcast(b"one")  # arms the flush timer
    flush = [p for p in a.actor.wakeups if p[2] == ("gm", "flush")]
    assert flush
    a.broadcast_many([b"x"] * 9)  # the batch is full: flushed, timer cancelled
    sent = a.counters["frames_out"]
    a.handle(WakeupMessage(0, flush[-1]))
    assert a.counters["frames_out"] == sent


def test_bad_arguments_are_named():
    net = Net()
    actor = FakeActor(net, 50000)
    with pytest.raises(ValueError, match="group"):
        GMShell(actor, "", Recorder(), agent=AGENT, node="n")
    with pytest.raises(TypeError, match="no method gm_delivered"):
        GMShell(actor, "g", object(), agent=AGENT, node="n")
    with pytest.raises(ValueError, match="agent"):
        GMShell(actor, "g", Recorder(), agent=None, node="n")
    with pytest.raises(ValueError, match="poll_interval"):
        GMShell(actor, "g", Recorder(), agent=AGENT, node="n", poll_interval=0)
    with pytest.raises(TypeError, match="GMMember"):
        GMShell(actor, "g", Recorder(), agent=AGENT, node="n", core_factory=lambda name: object())
    sh = GMShell(actor, "g", Recorder(), agent=AGENT, node="n", send_backoff=None)
    with pytest.raises(RuntimeError, match="start"):
        sh.create([sh.name])
    sh.start()
    with pytest.raises(ValueError, match="founder"):
        sh.create([])
    with pytest.raises(ValueError, match="twice"):
        sh.create([sh.name, sh.name])


def test_a_composite_core_gets_its_own_sends_and_events_routed_to_the_host():
    net = Net()

    class Composite:
        def __init__(self, name):
            self.gm = GMMember(name)

        def start(self, now):
            from mirrorq.sansio import Emit, Send

            return self.gm.start(now) + [Send("127.0.0.1:9", "hello"), Emit("promoted")]

    class Host(Recorder):
        def __init__(self):
            super().__init__()
            self.host_sends, self.events = [], []

        def gm_host_send(self, dst, msg):
            self.host_sends.append((dst, msg))

        def gm_event(self, ev):
            self.events.append(ev)

    host = Host()
    sh = GMShell(FakeActor(net, 50001), "g", host, agent=AGENT, node="n", send_backoff=None, core_factory=Composite)
    sh.start()
    assert host.host_sends == [("127.0.0.1:9", "hello")] and host.events == ["promoted"]
    assert sh.member is sh.core.gm


def test_a_turn_of_big_broadcasts_leaves_in_bounded_frames():
    """Ten 1 MiB broadcasts in one call: the core cuts them into activities
    of at most MAX_BATCH_BYTES and the shell puts them in frames of at most
    that much (not one frame for the turn), which deliver all ten in order."""
    from mirrorq.bounds import MAX_BATCH_BYTES

    net = Net()
    a, b = net.shell(node="n1"), net.shell(node="n2")
    a.create([a.name, b.name])
    net.settle()
    big = [bytes([i]) * (1 << 20) for i in range(10)]
    a.broadcast_many(big)
    pending, a.actor.wakeups = a.actor.wakeups, []
    for p in pending:  # the flush timer
        a.handle(WakeupMessage(0, p), None)
    frames = [m for _dst, m, _s in net.queue if isinstance(m, GMFrame)]
    assert len(frames) == 4
    assert all(len(f.body) <= MAX_BATCH_BYTES for f in frames)
    net.settle()
    assert [p for _s, p in recs(b)[0].delivered[a.name]] == big
    assert recs(a)[0].confirmed[-1][1] == 10
