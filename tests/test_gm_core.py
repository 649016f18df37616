"""Unit tests of the GM ring core (mirrorq.gm.core), message by message.

Multi-member flows here are driven by hand (each message handed to the next
core explicitly) so that a test can drop or hold one precise message; the
randomised distributed runs are in tests/test_gm_sim.py.
"""

from __future__ import annotations

import pytest
from gm_registry_oracle import REGISTRY, GMNode, RegistryOracle
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrorq.gm.core import (
    FLUSH_TIMER,
    TICK_TIMER,
    Activity,
    Confirmed,
    Delivered,
    GMMember,
    GMStopped,
    Item,
    MembersChanged,
    Nudge,
    ProposeView,
    Removed,
)
from mirrorq.gm.view import View
from mirrorq.sansio import CancelTimer, Emit, Send, SetTimer
from mirrorq.simulator import Simulator


def sends(actions) -> list[Send]:
    return [a for a in actions if isinstance(a, Send)]


def one_send(actions) -> Send:
    s = sends(actions)
    assert len(s) == 1, f"expected exactly one Send, got {s}"
    return s[0]


def events(actions, kind) -> list:
    return [a.event for a in actions if isinstance(a, Emit) and isinstance(a.event, kind)]


def delivered(actions) -> list[tuple[str, int]]:
    return [(e.origin, e.seq) for e in events(actions, Delivered)]


def ring(*names: str, version: int = 1, **kw) -> tuple[dict[str, GMMember], View, dict[str, list[Send]]]:
    """Founders of one view, installed; returns members, the view and the
    catch-ups each sent on installing it (not yet delivered)."""
    view = View(version, names)
    members = {n: GMMember(n, **kw) for n in names}
    first = {}
    for n, m in members.items():
        m.start(0.0)
        first[n] = sends(m.install_view(0.0, view))
    return members, view, first


def settle_catchups(members, first) -> None:
    """Deliver the install-time catch-ups around the ring until quiet."""
    queue = [(n, s) for n, ss in first.items() for s in ss]
    while queue:
        src, s = queue.pop(0)
        queue += [(s.dst, x) for x in sends(members[s.dst].receive(0.0, src, s.msg))]


def pump(members, queue: list[tuple[str, Send]]) -> list[tuple[str, object]]:
    """Hand queued (src, Send) messages on, FIFO, until none is left; return
    every (node, event) emitted on the way."""
    seen = []
    while queue:
        src, s = queue.pop(0)
        acts = members[s.dst].receive(0.0, src, s.msg)
        seen += [(s.dst, a.event) for a in acts if isinstance(a, Emit)]
        queue += [(s.dst, x) for x in sends(acts)]
    return seen


def hand(members, src: str, send: Send, t: float = 0.0):
    """Give one message to its destination; return the destination's actions."""
    return members[send.dst].receive(t, src, send.msg)


# ---- View -----------------------------------------------------------------
def test_view_neighbours_and_validation() -> None:
    v = View(3, ("a", "b", "c"))
    assert (v.left("a"), v.right("a")) == ("c", "b")
    assert (v.left("c"), v.right("c")) == ("b", "a")
    assert v.without("b") == ("a", "c")
    with pytest.raises(ValueError, match="twice"):
        View(1, ("a", "b", "a"))
    with pytest.raises(ValueError, match="at least one"):
        View(1, ())
    with pytest.raises(TypeError, match="tuple"):
        View(1, ["a"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version"):
        View(-1, ("a",))
    with pytest.raises(ValueError, match="not a member"):
        v.left("z")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=8, unique=True))
def test_view_ring_walk_visits_everyone_once(names: list[str]) -> None:
    v = View(1, tuple(names))
    seen, cur = [], names[0]
    for _ in names:
        seen.append(cur)
        assert v.left(v.right(cur)) == cur
        cur = v.right(cur)
    assert cur == names[0] and sorted(seen) == sorted(names)


# ---- bad input ----------------------------------------------------------------
def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="name"):
        GMMember("")
    with pytest.raises(ValueError, match="max_batch"):
        GMMember("a", max_batch=0)
    with pytest.raises(ValueError, match="tick_interval"):
        GMMember("a", tick_interval=0)
    m = GMMember("a")
    with pytest.raises(TypeError, match="View"):
        m.install_view(0.0, ("a",))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected Activity"):
        m.receive(0.0, "b", "hello")
    with pytest.raises(ValueError, match="no timer"):
        m.timer(0.0, "bogus")
    with pytest.raises(ValueError, match="member name"):
        m.member_down(0.0, "")


# ---- one member ---------------------------------------------------------------
def test_alone_a_broadcast_is_confirmed_at_once() -> None:
    m = GMMember("a")
    m.install_view(0.0, View(1, ("a",)))
    acts = m.broadcast(0.0, "x")
    assert delivered(acts) == [("a", 1)]
    assert events(acts, Confirmed) == [Confirmed(1, 1)]
    assert sends(acts) == [] and m.idle()


def test_broadcast_before_the_first_view_waits_then_goes_out() -> None:
    members = {n: GMMember(n) for n in ("a", "b")}
    acts = members["a"].broadcast(0.0, "early")
    assert delivered(acts) == [("a", 1)] and sends(acts) == []
    view = View(1, ("a", "b"))
    first = {n: sends(m.install_view(0.0, view)) for n, m in members.items()}
    assert first["a"][0].msg.items[0].pubs == ((1, "early"),)
    settle_catchups(members, first)
    assert members["a"].idle() and members["b"].members_state["a"].last_pub == 1


def test_founders_send_no_catch_up_on_a_first_view_with_nothing_sent_but_do_on_the_next() -> None:
    ms, _view, first = ring("a", "b", "c")
    assert first == {"a": [], "b": [], "c": []}  # base 0 everywhere, nothing pending: nothing to catch up
    # the first broadcast still goes round and is confirmed
    acts = ms["a"].broadcast(0.0, "p1") + ms["a"].end_turn(0.0)
    seen = pump(ms, [("a", s) for s in sends(acts)])
    assert ("a", Confirmed(1, 1)) in seen
    # a later view: every member sends its catch-up
    later = View(2, ("a", "b"))
    assert all(len(sends(ms[n].install_view(0.1, later))) == 1 for n in ("a", "b"))


# ---- the publish and ack rounds -------------------------------------------------
def test_publish_round_then_ack_round_around_three() -> None:
    ms, view, first = ring("a", "b", "c")
    settle_catchups(ms, first)
    acts = ms["a"].broadcast(0.0, "p1")
    assert delivered(acts) == [("a", 1)]
    assert SetTimer(FLUSH_TIMER, ms["a"].flush_interval) in acts
    ab = one_send(ms["a"].timer(0.001, FLUSH_TIMER))
    assert ab.dst == "b" and ab.msg.items == (Item("a", ((1, "p1"),), marker=1),)
    bc = one_send(acts_b := hand(ms, "a", ab))
    assert delivered(acts_b) == [("a", 1)] and ms["b"].members_state["a"].pending_ack[0] == (1, "p1")
    ca = one_send(acts_c := hand(ms, "b", bc))
    assert delivered(acts_c) == [("a", 1)] and ca.dst == "a"
    # back at the origin: everywhere -> confirm and start the ack round
    back = hand(ms, "c", ca)
    assert events(back, Confirmed) == [Confirmed(1, 1)] and delivered(back) == []
    ack = one_send(back)
    assert ack.msg.items == (Item("a", (), None, 1),)
    ack2 = one_send(hand(ms, "a", ack))
    assert not ms["b"].members_state["a"].pending_ack
    ack3 = one_send(hand(ms, "b", ack2))
    assert not ms["c"].members_state["a"].pending_ack
    assert sends(hand(ms, "c", ack3)) == []  # the ack round ends at the origin
    assert all(m.idle() for m in ms.values())


def test_the_last_member_sends_its_right_nothing_for_the_rights_own_pubs_alone() -> None:
    """The member before the origin delivers the origin's pubs but cannot
    forward the round's marker yet (it has not had it): the origin's pubs are
    all it would carry, and the origin never takes its own pubs back, so no
    message goes (it used to be an empty one, and a turn of the origin's)."""
    ms, view, first = ring("a", "b", "c")
    settle_catchups(ms, first)
    ms["a"].broadcast(0.0, "p1")
    ab = one_send(ms["a"].timer(0.001, FLUSH_TIMER))
    bc = one_send(hand(ms, "a", ab))
    # b's message reaches c without its marker: c holds p1 and has nothing to tell a
    lost_marker = type(bc.msg)(bc.msg.version, tuple(type(i)(i.origin, i.pubs) for i in bc.msg.items))
    acts = ms["c"].receive(0.0, "b", lost_marker)
    assert delivered(acts) == [("a", 1)] and sends(acts) == []
    # the marker, when it comes, goes on to a as before
    ca = one_send(hand(ms, "b", bc))
    assert ca.dst == "a" and ca.msg.items == (Item("a", (), marker=1),)


def test_many_publishes_and_acks_ride_in_one_message_per_hop() -> None:
    ms, view, first = ring("a", "b", "c", max_batch=100)
    settle_catchups(ms, first)
    batches = []
    for i in range(250):
        acts = ms["a"].broadcast(0.0, i)
        if i in (99, 199):
            batches.append(one_send(acts).msg)
            assert len(batches[-1].items[0].pubs) == 100  # a full buffer goes at once
        else:
            assert sends(acts) == []
    batches.append(one_send(ms["a"].flush(0.0)).msg)
    assert [s for s, _ in batches[-1].items[0].pubs] == list(range(201, 251))
    to_c = []
    for msg in batches[:2]:
        acts = ms["b"].receive(0.0, "a", msg)
        assert len(delivered(acts)) == 100
        to_c.append(("b", one_send(acts)))
    # b's own broadcast rides on the message b forwards anyway
    ms["b"].broadcast(0.0, "b1")
    acts = ms["b"].receive(0.0, "a", batches[2])
    fwd = one_send(acts).msg
    assert CancelTimer(FLUSH_TIMER) in acts and not ms["b"].broadcast_buffer
    assert [(it.origin, len(it.pubs), it.marker) for it in fwd.items] == [("a", 50, 250), ("b", 1, 1)]
    # the round back to a: one message per hop for 251 publishes of 2 origins
    seen = pump(ms, to_c + [("b", Send("c", fwd))])
    assert [(n, e) for n, e in seen if isinstance(e, Confirmed)] == [
        ("a", Confirmed(1, 100)),
        ("a", Confirmed(101, 200)),
        ("a", Confirmed(201, 250)),
        ("b", Confirmed(1, 1)),
    ]
    assert all(m.idle() for m in ms.values())


def test_duplicates_are_suppressed_and_gaps_block_delivery() -> None:
    ms, view, first = ring("a", "b", "c")
    settle_catchups(ms, first)
    b = ms["b"]
    m1 = Activity(1, (Item("a", ((1, "x"),), marker=1),))
    m2 = Activity(1, (Item("a", ((2, "y"),), marker=2),))
    m3 = Activity(1, (Item("a", ((3, "z"),), marker=3),))
    assert delivered(b.receive(0.0, "a", m1)) == [("a", 1)]
    assert delivered(b.receive(0.0, "a", m1)) == []  # duplicate
    assert delivered(b.receive(0.0, "a", m3)) == []  # 2 is missing: not skipped
    assert b.stats.gaps == 1 and b.members_state["a"].last_pub == 1
    out = b.receive(0.0, "a", m2)
    assert delivered(out) == [("a", 2)]
    # the marker forwarded never claims more than b holds
    assert one_send(out).msg.items[0].marker == 2


def test_messages_only_from_the_left_of_the_current_view() -> None:
    ms, view, first = ring("a", "b", "c")
    b = ms["b"]
    msg = Activity(1, (Item("a", ((1, "x"),), marker=1),))
    assert b.receive(0.0, "c", msg) == []  # c is b's right, not its left
    assert b.receive(0.0, "a", Activity(0, msg.items)) == []  # an older view
    assert b.stats.stale == 2
    # a message for a view b has not installed yet waits for it
    assert b.receive(0.0, "a", Activity(2, msg.items)) == []
    acts = b.install_view(0.0, View(2, ("a", "b", "c", "d")))
    assert delivered(acts) == [("a", 1)]


# ---- view changes -------------------------------------------------------------
def test_member_down_proposes_a_view_without_it_and_retries() -> None:
    ms, view, first = ring("a", "b", "c", "d")
    acts = ms["a"].member_down(0.0, "c")
    assert events(acts, ProposeView) == [ProposeView(1, ("a", "b", "d"))]
    acts = ms["a"].member_down(0.0, "d")
    assert events(acts, ProposeView) == [ProposeView(1, ("a", "b"))]
    assert ms["a"].member_down(0.0, "zz") == []  # not a member: nothing to propose
    # another proposal won (it removed c only): propose again against it
    acts = ms["a"].install_view(0.0, View(2, ("a", "b", "d")))
    assert events(acts, ProposeView) == [ProposeView(2, ("a", "b"))]
    # and again on every tick until the registry answers
    tick = ms["a"].timer(1.0, TICK_TIMER)
    assert events(tick, ProposeView) == [ProposeView(2, ("a", "b"))]
    ms["a"].install_view(0.0, View(3, ("a", "b")))
    assert events(ms["a"].timer(2.0, TICK_TIMER), ProposeView) == []


def test_removed_member_stops() -> None:
    ms, view, first = ring("a", "b", "c")
    acts = ms["c"].install_view(0.0, View(2, ("a", "b")))
    assert events(acts, Removed) == [Removed()]
    assert CancelTimer(TICK_TIMER) in acts
    assert ms["c"].receive(0.0, "b", Activity(2, ())) == []
    with pytest.raises(GMStopped, match="removed"):
        ms["c"].broadcast(0.0, "late")
    with pytest.raises(GMStopped):
        ms["c"].join(0.0)


def test_join_proposes_itself_until_admitted() -> None:
    j = GMMember("j")
    assert events(j.join(0.0), ProposeView) == []  # no view heard of yet
    acts = j.install_view(0.0, View(4, ("a", "b")))  # a view without us: re-propose
    assert events(acts, ProposeView) == [ProposeView(4, ("a", "b", "j"))]
    assert events(j.timer(1.0, TICK_TIMER), ProposeView) == [ProposeView(4, ("a", "b", "j"))]
    acts = j.install_view(0.0, View(5, ("a", "b", "j")))
    assert events(acts, MembersChanged) == [MembersChanged(View(5, ("a", "b", "j")), ("a", "b"), ())]
    assert events(j.timer(2.0, TICK_TIMER), ProposeView) == []


def test_catchup_after_a_death_reaches_the_new_right() -> None:
    """a -> b -> c -> d: c dies after delivering p1 but before forwarding it.
    In the new view b re-sends to d; a is confirmed only once d has it."""
    ms, view, first = ring("a", "b", "c", "d")
    settle_catchups(ms, first)
    ab = one_send(ms["a"].broadcast(0.0, "p1") + ms["a"].flush(0.0))
    bc = one_send(hand(ms, "a", ab))
    assert delivered(hand(ms, "b", bc)) == [("a", 1)]  # c delivers it ... and dies
    assert ms["d"].members_state["a"].last_pub == 0
    v2 = View(2, ("a", "b", "d"))
    cu = {n: sends(ms[n].install_view(0.1, v2)) for n in ("a", "b", "d")}
    assert [s.dst for s in cu["b"]] == ["d"]
    seen = pump(ms, [(n, s) for n in ("a", "b", "d") for s in cu[n]])
    d_got = seen.index(("d", Delivered("a", 1, "p1")))
    a_conf = seen.index(("a", Confirmed(1, 1)))
    assert d_got < a_conf
    assert sum(isinstance(e, Delivered) for _, e in seen) == 1  # no duplicates at a or b
    assert all(ms[n].idle() for n in ("a", "b", "d"))


def test_dead_origin_messages_reach_all_survivors_and_are_acked() -> None:
    """a's p1 reached b only; a dies. The alias (first member of the new
    view) completes a round for it: c and d deliver it, buffers drain, and
    nobody confirms (only a could, and a is gone)."""
    ms, view, first = ring("a", "b", "c", "d")
    settle_catchups(ms, first)
    ab = one_send(ms["a"].broadcast(0.0, "p1") + ms["a"].flush(0.0))
    hand(ms, "a", ab)  # b delivers and forwards to c; that message is lost
    v2 = View(2, ("b", "c", "d"))
    survivors = {n: ms[n] for n in ("b", "c", "d")}
    got = []
    queue = [(n, s) for n in survivors for s in sends(ms[n].install_view(0.1, v2))]
    while queue:
        src, s = queue.pop(0)
        acts = hand(ms, src, s)
        got += [(s.dst, o, q) for o, q in delivered(acts)]
        assert events(acts, Confirmed) == []
        queue += [(s.dst, x) for x in sends(acts)]
    assert sorted(got) == [("c", "a", 1), ("d", "a", 1)]
    assert all(m.idle() for m in survivors.values())


def test_joiner_gets_what_is_in_flight_not_older() -> None:
    ms, view, first = ring("a", "b")
    settle_catchups(ms, first)
    # p1 goes all the way round and is acked before j joins
    q = sends(ms["a"].broadcast(0.0, "old") + ms["a"].flush(0.0))
    src = "a"
    while q:
        s = q.pop(0)
        q += sends(hand(ms, src, s))
        src = s.dst
    assert ms["a"].idle() and ms["b"].idle()
    # p2 is in flight (b has it, a has not seen it back) when j joins
    ab = one_send(ms["a"].broadcast(0.0, "new") + ms["a"].flush(0.0))
    ba = one_send(hand(ms, "a", ab))
    j = ms["j"] = GMMember("j")
    j.join(0.0)
    v2 = View(2, ("a", "b", "j"))
    cu = {n: sends(ms[n].install_view(0.1, v2)) for n in ("a", "b", "j")}
    assert hand(ms, "b", ba) == []  # the old view's message is stale now
    to_j = hand(ms, "b", cu["b"][0])
    assert delivered(to_j) == [("a", 2)]  # in flight: yes; "old": not its business
    confirms = []
    queue = [(n, s) for n in ("a", "j") for s in cu[n]] + [("j", s) for s in sends(to_j)]
    while queue:
        src, s = queue.pop(0)
        acts = hand(ms, src, s)
        confirms += events(acts, Confirmed)
        queue += [(s.dst, x) for x in sends(acts)]
    assert confirms == [Confirmed(2, 2)]
    assert all(m.idle() for m in ms.values())


def test_a_joiner_catches_up_a_backlog_in_bounded_activities() -> None:
    """a's ten 1 MiB pubs are unacked when j joins: the catch-up b sends j
    (a full item of a's whole backlog) leaves in activities of at most
    MAX_BATCH_BYTES, every one a full run carrying the base; j delivers all
    ten in order and a's round completes with j in it."""
    from mirrorq.bounds import MAX_BATCH_BYTES
    from mirrorq.gm.messages import encode

    ms, view, first = ring("a", "b")
    settle_catchups(ms, first)
    payloads = [bytes([i]) * (1 << 20) for i in range(10)]
    acts = []
    for p in payloads:
        acts += ms["a"].broadcast(0.0, p)
    ab = sends(acts + ms["a"].flush(0.0))
    assert [len(s.msg.items[0].pubs) for s in ab] == [3, 3, 3, 1]  # a's own broadcast, bounded too
    for s in ab:
        hand(ms, "a", s)  # b delivers; what it sends back to a is lost
    j = ms["j"] = GMMember("j")
    j.join(0.0)
    v2 = View(2, ("a", "b", "j"))
    cu = {n: sends(ms[n].install_view(0.1, v2)) for n in ("a", "b", "j")}
    to_j = [s for s in cu["b"] if s.dst == "j"]
    runs = [it for s in to_j for it in s.msg.items if it.origin == "a"]
    assert len(runs) == 4 and all(it.full and it.ack == 0 for it in runs)
    for s in to_j:
        assert s.msg.nbytes <= MAX_BATCH_BYTES
        assert len(encode([s.msg], "j")) <= MAX_BATCH_BYTES
    got, confirms = [], []
    queue = [(n, s) for n in ("a", "b", "j") for s in cu[n]]
    while queue:
        src, s = queue.pop(0)
        assert isinstance(s.msg, Nudge) or s.msg.nbytes <= MAX_BATCH_BYTES
        acts = hand(ms, src, s)
        got += [(s.dst, e) for e in events(acts, Delivered)]
        confirms += events(acts, Confirmed)
        queue += [(s.dst, x) for x in sends(acts)]
    at_j = [e for node, e in got if node == "j" and e.origin == "a"]
    assert [e.seq for e in at_j] == list(range(1, 11)) and [e.payload for e in at_j] == payloads
    assert confirms == [Confirmed(1, 10)]
    assert all(m.idle() for m in ms.values())


def test_a_lost_message_is_retransmitted_not_skipped() -> None:
    ms, view, first = ring("a", "b", "c", tick_interval=1.0)
    settle_catchups(ms, first)
    ab1 = one_send(ms["a"].broadcast(0.0, "p1") + ms["a"].flush(0.0))
    hand(ms, "a", ab1)  # b -> c lost
    ab2 = one_send(ms["a"].broadcast(0.0, "p2") + ms["a"].flush(0.0))
    bc2 = one_send(hand(ms, "a", ab2))
    assert delivered(hand(ms, "b", bc2)) == []  # c has a gap: p2 waits
    # b sees no ack progress for a tick: it re-sends its catch-up to c
    tick = ms["b"].timer(1.0, TICK_TIMER)
    assert Nudge(1) in [s.msg for s in sends(tick) if s.dst == "a"]
    (bc,) = [s for s in sends(tick) if s.dst == "c"]
    acts = hand(ms, "b", bc)
    assert delivered(acts) == [("a", 1), ("a", 2)]
    back = hand(ms, "c", one_send(acts))
    assert events(back, Confirmed) == [Confirmed(1, 2)]


def test_a_lost_ack_is_recovered_by_a_nudge() -> None:
    ms, view, first = ring("a", "b", "c", tick_interval=1.0)
    settle_catchups(ms, first)
    q = one_send(ms["a"].broadcast(0.0, "p1") + ms["a"].flush(0.0))
    q = one_send(hand(ms, "a", q))
    q = one_send(hand(ms, "b", q))
    ack = one_send(hand(ms, "c", q))  # a confirmed; the ack a -> b is lost
    assert ms["a"].idle() and not ms["b"].idle()
    tick = ms["b"].timer(1.0, TICK_TIMER)
    nudge = [s for s in sends(tick) if s.dst == "a"]
    assert [s.msg for s in nudge] == [Nudge(1)]
    resend = one_send(hand(ms, "b", nudge[0]))
    assert resend.dst == "b"
    hand(ms, "a", resend)
    assert ms["b"].idle() and ack.msg.items[0].ack == 1


# ---- with the simulator: the minority partition ------------------------------------
def _cluster(seed: int, names: tuple[str, ...]) -> Simulator:
    sim = Simulator(seed, fifo=True)
    for n in names:
        sim.add_node(n, lambda name, disk: GMNode(name, tick_interval=0.05))
    sim.add_node(REGISTRY, lambda name, disk: RegistryOracle(names))
    sim.run_for(0.2)
    return sim


def _confirmed(sim: Simulator, node: str) -> int:
    evs = sim.events(node, Confirmed)
    return evs[-1][2].last if evs else 0


@pytest.mark.parametrize("seed", range(3), ids=lambda s: f"seed={s}")
def test_split_ring_confirms_nothing_until_healed(seed: int) -> None:
    names = ("m0", "m1", "m2", "m3", "m4")
    sim = _cluster(seed, names)
    sim.call("m0", "broadcast", "before")
    sim.call("m3", "broadcast", "before")
    sim.run_for(0.2)
    assert _confirmed(sim, "m0") == 1 and _confirmed(sim, "m3") == 1
    sim.partition(["m0", "m1"])  # m2, m3, m4 and the registry on the other side
    for n in ("m0", "m3"):
        sim.call(n, "broadcast", "during")
    sim.run_for(2.0)
    assert _confirmed(sim, "m0") == 1 and _confirmed(sim, "m3") == 1  # the ring is cut
    sim.heal()  # no liveness report: nobody changed the view
    sim.run_for(1.0)
    assert _confirmed(sim, "m0") == 2 and _confirmed(sim, "m3") == 2
    for n in names:
        assert sim.core(n).member.view.version == 1
        assert [e.seq for _, _, e in sim.events(n, Delivered) if e.origin == "m0"] == [1, 2]


@pytest.mark.parametrize("seed", range(3), ids=lambda s: f"seed={s}")
def test_minority_cannot_change_the_view_nor_confirm(seed: int) -> None:
    names = ("m0", "m1", "m2", "m3", "m4")
    sim = _cluster(seed, names)
    sim.partition(["m0", "m1"])
    for a in names:
        for b in names:
            if (a in ("m0", "m1")) != (b in ("m0", "m1")):
                sim.call(a, "member_down", b)
    for n in ("m0", "m3"):
        sim.call(n, "broadcast", "during")
    sim.run_for(1.0)
    # the majority side (with the registry) moved on and confirms again
    assert sim.core("m3").member.view.members == ("m2", "m3", "m4")
    assert _confirmed(sim, "m3") == 1
    # the minority proposed, could not commit, and confirms nothing
    assert sim.events("m0", ProposeView)
    assert sim.core("m0").member.view.version == 1 and _confirmed(sim, "m0") == 0
    assert not any(e.origin == "m0" for _, n, e in sim.events(kind=Delivered) if n in ("m2", "m3", "m4"))
    sim.heal()
    sim.run_for(1.0)
    for n in ("m0", "m1"):
        assert sim.events(n, Removed), f"{n} should learn it was removed"
    assert _confirmed(sim, "m0") == 0  # never learnt "everywhere" for what m2-m4 lack
    assert sim.core(REGISTRY).view.members == ("m2", "m3", "m4")


def test_wire_messages_and_events_survive_pickling() -> None:
    """The actor shell ships Activity/Nudge between processes (Thespian
    pickles) and hands events to other actors."""
    import pickle

    for obj in (
        Activity(3, (Item("a", ((1, b"x"), (2, {"k": 1})), 2, None, True), Item("b", (), None, 7))),
        Nudge(3),
        View(2, ("a", "b")),
        Delivered("a", 1, "p"),
        Confirmed(1, 2),
        ProposeView(1, ("a",)),
        MembersChanged(View(1, ("a",)), (), ()),
        Removed(),
    ):
        assert pickle.loads(pickle.dumps(obj)) == obj
