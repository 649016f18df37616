"""Sync of a late-joining mirror under the simulator, while the queue serves.

Seeds mix: a fresh mirror joining (full sync), a killed mirror coming back on
its durable store as a new member (delta sync), manual mode released by
sync_queue, and a master kill during or after the sync.  On top of the
checks of test_queue_sim (nothing confirmed lost, no double enqueue, acks
final, order), every surviving replica ends synchronised with a store
identical to the master's; a delta sync transfers only what is missing.

Replay: ``pytest 'tests/test_queue_sync_sim.py::test_join_and_sync[seed=5]'``.
"""

from __future__ import annotations

import random

import pytest
from queue_sim_support import Operator, ReplicaNode, build
from test_queue_sim import _check

SEEDS = 200


def _same_state(replicas):
    ref = replicas[0].bq
    for r in replicas[1:]:
        assert r.bq.ready_offsets() == ref.ready_offsets(), f"{r.member} ready differs from {replicas[0].member}"
        assert r.bq.unacked_offsets() == ref.unacked_offsets(), f"{r.member} unacked differs"
        assert r.bq.log.next_offset == ref.log.next_offset


@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda s: f"seed={s}")
def test_join_and_sync(seed, tmp_path):
    rng = random.Random(seed)
    mode = rng.choice(["automatic", "automatic", "manual"])
    policy = {"ha-sync-mode": mode, "ha-sync-batch-size": rng.choice([1, 7, 50, 4096])}
    total = rng.choice([200, 300])
    sim, names = build(seed, replicas=3, total=total, fifo=rng.random() < 0.5, directory=str(tmp_path), policy=policy)
    members = list(names)
    delta = rng.random() < 0.5
    t_join = rng.uniform(0.05, 0.3)
    joiner = "q2b" if delta else "j1"
    state = {}

    def join(s):
        if delta:
            old = s.core("q2").replica
            state["had"] = old.bq.log.next_offset
            s.kill("q2")
            old.bq.close(flush=False)  # the process died: its lock goes with it
            for n in ("q0", "q1"):
                s.schedule(
                    s.now + rng.uniform(0.005, 0.05),
                    lambda s2, n=n: n in s2.alive() and s2.call(n, "member_down", "q2"),
                )
            members.remove("q2")
            directory, disk = f"{tmp_path}/q2", s.nodes["q2"].disk  # q2's machine, its files
        else:
            directory, disk = f"{tmp_path}/j1", None
        s.add_node(
            joiner,
            lambda n, d: ReplicaNode(
                n, None, directory=directory, joining=True, policy=policy, disk=d if disk is None else disk
            ),
        )
        members.append(joiner)

    sim.schedule(t_join, join)
    if mode == "manual":
        sim.add_node("op", lambda n, d: Operator(n))
        sim.schedule(t_join + rng.uniform(0.2, 0.6), lambda s: s.call("op", "command", "sync"))
        # a second sync_queue later in case the first came before the mirror asked (it then waits again)
        sim.schedule(t_join + 1.5, lambda s: s.call("op", "command", "sync"))
    killed: list = []
    if rng.random() < 0.3:

        def kill_master(s):
            if "q0" in s.alive():
                s.kill("q0")
                killed.append("q0")
                for n in members:
                    if n != "q0":
                        s.schedule(
                            s.now + rng.uniform(0.005, 0.05),
                            lambda s2, n=n: n in s2.alive() and s2.call(n, "member_down", "q0"),
                        )

        sim.schedule(t_join + rng.uniform(0.01, 0.5), kill_master)

    def all_synced():
        alive = [sim.core(n).replica for n in members if n in sim.alive()]
        masters = [r for r in alive if r.is_master]
        return (
            len(masters) == 1
            and all(r.is_synced for r in alive)
            and set(masters[0].synced_members) >= {r.member for r in alive}
        )

    assert sim.run_until(lambda: joiner in sim.alive() and all_synced(), timeout=30), (
        f"joiner never synchronised: mode={mode} delta={delta} "
        f"{[sim.core(n).replica.info() for n in members if n in sim.alive()]}"
    )
    _check(sim, members, total, killed)
    alive_names = [n for n in members if n in sim.alive()]
    _same_state([sim.core(n).replica for n in alive_names])
    j = sim.core(joiner).replica
    if delta and "q0" not in killed:
        master = next(sim.core(n).replica for n in alive_names if sim.core(n).replica.is_master)
        # only what the mirror missed travels: not the whole log (what it had, less what
        # was not fsynced when its machine lost power: its disk is simulated)
        had = min(state["had"], sim.core(joiner).opened_next)
        assert j.stats["sync_records_received"] <= master.bq.log.next_offset - had + 1


@pytest.mark.parametrize("graceful", [True, False], ids=["shutdown", "failure"])
@pytest.mark.parametrize("rule", ["when-synced", "always"])
def test_promotion_rules_with_only_an_unsynchronised_mirror(tmp_path, graceful, rule):
    """Master + one unsynchronised mirror (manual sync, never started): the
    master stops gracefully or dies.  ha-promote-on-shutdown (default
    when-synced) / ha-promote-on-failure (default always) decide whether the
    unsynchronised mirror takes over or the queue stays down."""
    from mirrorq.classic.replica import QueueDown

    key = "ha-promote-on-shutdown" if graceful else "ha-promote-on-failure"
    policy = {"ha-sync-mode": "manual", key: rule}
    sim, names = build(7, replicas=1, total=50, directory=str(tmp_path), policy=policy)
    sim.kill("con")  # the queue keeps messages the new mirror lacks: it stays unsynchronised
    pub = sim.core("pub")
    assert sim.run_until(lambda: pub.done(), timeout=10)
    sim.add_node(
        "j1", lambda n, d: ReplicaNode(n, None, directory=f"{tmp_path}/j1", joining=True, policy=policy, disk=d)
    )
    assert sim.run_until(
        lambda: (
            sim.core("j1").replica.gm.view is not None
            and "j1" in sim.core("j1").replica.gm.view
            and sim.core("j1").replica.master == "q0"
        ),
        timeout=10,
    )
    assert not sim.core("j1").replica.is_synced
    if graceful:
        sim.call("q0", "shutdown")
        sim.run_for(0.05)
    sim.kill("q0")
    sim.call("j1", "member_down", "q0")
    sim.run_for(3.0)
    j1 = sim.core("j1").replica
    promoted = j1.is_master
    down = any(isinstance(ev, QueueDown) for _, n, ev in sim.emitted if n == "j1")
    assert promoted == (rule == "always") and down == (rule != "always")


@pytest.mark.parametrize("seed", range(10), ids=lambda s: f"seed={s}")
def test_manual_mirror_that_lacks_nothing_is_synchronised_at_once(seed, tmp_path):
    """ha-sync-mode manual: a mirror joining a drained queue (or one whose
    log already ends where the master's does) needs no sync_queue."""
    policy = {"ha-sync-mode": "manual"}
    sim, names = build(seed, replicas=2, total=100, directory=str(tmp_path), policy=policy)
    pub, _con = sim.core("pub"), sim.core("con")
    assert sim.run_until(lambda: pub.done() and sim.core("q0").replica.bq.message_count == 0, timeout=20)
    sim.add_node(
        "j1", lambda n, d: ReplicaNode(n, None, directory=f"{tmp_path}/j1", joining=True, policy=policy, disk=d)
    )
    assert sim.run_until(
        lambda: sim.core("j1").replica.is_synced and "j1" in sim.core("q0").replica.synced_members, timeout=10
    ), sim.core("j1").replica.info()


def test_manual_mirror_waits_for_sync_queue_while_the_queue_holds_messages(tmp_path):
    policy = {"ha-sync-mode": "manual"}
    sim, names = build(3, replicas=2, total=100, directory=str(tmp_path), policy=policy)
    sim.kill("con")  # nobody drains the queue
    pub = sim.core("pub")
    assert sim.run_until(lambda: pub.done(), timeout=20)
    sim.add_node(
        "j1", lambda n, d: ReplicaNode(n, None, directory=f"{tmp_path}/j1", joining=True, policy=policy, disk=d)
    )
    sim.add_node("op", lambda n, d: Operator(n))
    sim.run_for(3.0)
    assert not sim.core("j1").replica.is_synced
    sim.call("op", "command", "sync")
    assert sim.run_until(lambda: sim.core("j1").replica.is_synced, timeout=10)
    _same_state([sim.core("q0").replica, sim.core("j1").replica])


@pytest.mark.parametrize("seed", range(40), ids=lambda s: f"seed={s}")
def test_a_deposed_master_cuts_its_log_back_to_where_it_parted_and_syncs_the_rest(seed, tmp_path):
    """The master is cut off with its publisher (its PUBLISH records never
    reach the mirrors), dies, and a mirror takes over; its store comes back
    as a joining mirror.  Its log and the new master's part at the new
    master's EPOCH record: it cuts its own back to there and takes only what
    follows (a delta, not a reset); everything confirmed is kept, the
    replicas end identical, and nothing it held alone comes back."""
    rng = random.Random(seed)
    sim, names = build(
        seed,
        replicas=3,
        total=300,
        fifo=rng.random() < 0.5,
        directory=str(tmp_path),
        policy={"ha-sync-mode": "automatic"},
    )
    members = list(names)
    state: dict = {}
    t_cut = rng.uniform(0.1, 0.3)

    def cut(s):
        s.partition(["q0", "pub"])  # q0 goes on taking its publisher's publishes, alone

    def depose(s):
        old = s.core("q0").replica
        state["old_next"] = old.bq.log.next_offset
        s.kill("q0")
        old.bq.close(flush=False)
        s.heal()
        members.remove("q0")
        for n in ("q1", "q2"):
            s.call(n, "member_down", "q0")

    def rejoin(s):
        master = next(s.core(n).replica for n in ("q1", "q2") if s.core(n).replica.is_master)
        state["epochs"] = list(master.bq.epochs)
        s.add_node(
            "q0b",
            lambda n, d: ReplicaNode(
                n,
                None,
                directory=f"{tmp_path}/q0",
                joining=True,
                policy={"ha-sync-mode": "automatic"},
                disk=s.nodes["q0"].disk,  # q0's machine, its files
            ),
        )
        members.append("q0b")

    sim.schedule(t_cut, cut)
    sim.schedule(t_cut + rng.uniform(0.02, 0.1), depose)
    sim.run(t_cut + 0.5)
    # its store comes back once a mirror has taken over
    assert sim.run_until(lambda: any(sim.core(n).replica.is_master for n in ("q1", "q2")), timeout=10)
    rejoin(sim)

    def all_synced():
        alive = [sim.core(n).replica for n in members if n in sim.alive()]
        masters = [r for r in alive if r.is_master]
        return (
            "q0b" in sim.alive()
            and len(masters) == 1
            and all(r.is_synced for r in alive)
            and set(masters[0].synced_members) >= {r.member for r in alive}
        )

    assert sim.run_until(all_synced, timeout=30), [sim.core(n).replica.info() for n in members if n in sim.alive()]
    _check(sim, members, 300, ["q0"])
    alive = [sim.core(n).replica for n in members if n in sim.alive()]
    _same_state(alive)
    epochs = state["epochs"]
    assert epochs[0] == (0, "q0") and epochs[-1][1] in ("q1", "q2"), epochs
    parted = epochs[-1][0]
    j = sim.core("q0b").replica
    assert j.bq.epochs[: len(epochs)] == epochs  # its own era's records past the parting are gone
    # a delta from the parting point (or from where its store ends, if it lost the
    # records it had not fsynced before the power loss), not the whole log again
    start = min(parted, sim.core("q0b").opened_next)
    assert j.stats["sync_records_received"] <= alive[0].bq.log.next_offset - start + 1
    if sim.core("q0b").opened_next > parted:
        assert j.stats["sync_records_received"] < alive[0].bq.log.next_offset


def test_a_lost_sync_start_is_asked_for_again_long_before_the_transfer_timeout(tmp_path):
    """The master's first answer to a joining mirror (SyncStart, with the
    first batch) is lost -- a link reset at a heal does that.  The mirror
    asks again after SYNC_ANSWER_TIMEOUT, not after SYNC_TIMEOUT, and the
    new request replaces the master's transfer."""
    from mirrorq.classic import sync

    sim, names = build(11, replicas=2, total=100, directory=str(tmp_path), policy={"ha-sync-mode": "automatic"})
    sim.kill("con")  # the queue keeps its messages: the joiner must take them by sync
    pub = sim.core("pub")
    assert sim.run_until(lambda: pub.done(), timeout=20)
    lost: list = []
    send = sim._send

    def lose_first_sync_start(src, dst, msg):
        if dst == "j1" and isinstance(msg, sync.SyncStart) and not lost:
            lost.append(msg)
            return
        send(src, dst, msg)

    sim._send = lose_first_sync_start
    sim.add_node(
        "j1",
        lambda n, d: ReplicaNode(
            n, None, directory=f"{tmp_path}/j1", joining=True, policy={"ha-sync-mode": "automatic"}, disk=d
        ),
    )
    start = sim.now
    assert sim.run_until(lambda: sim.core("j1").replica.is_synced, timeout=sync.SYNC_TIMEOUT)
    assert lost and sim.now - start < sync.SYNC_ANSWER_TIMEOUT + 2 * sync.SYNC_RETRY + 1.0
    _same_state([sim.core("q0").replica, sim.core("j1").replica])


def test_a_sync_batch_from_a_master_that_left_the_view_is_ignored():
    """A mirror receiving a sync transfer hears of a view without its master
    (it died, or handed over) before a batch the master sent arrives: the
    batch is of a void transfer.  The mirror neither answers it (it has no
    master to answer: an ack addressed to None, which a real node's host
    cannot post and crashes the replica over) nor completes the sync with
    it (which would skip the operations it kept from that master and call
    itself synchronised); the new master's sync replaces the transfer."""
    from mirrorq.classic import sync
    from mirrorq.classic.backing_queue import BackingQueue
    from mirrorq.classic.replica import QueueReplica, QueueSpec
    from mirrorq.gm.view import View
    from mirrorq.sansio import Send

    master_log = BackingQueue(None, durable=False)  # what the master streams: an epoch and 4 publishes
    master_log.begin_epoch("q0")
    for i in range(4):
        master_log.publish(f"m{i}", b"body")
    raw = master_log.log.read_raw(0, until=master_log.log.next_offset, include_pending=True)

    r = QueueReplica(
        "j1", "j1", QueueSpec("q", durable=False), BackingQueue(None, durable=False), master="q0", joining=True
    )
    r.install_view(0.0, View(1, ("q0", "q1", "j1")))
    mirror = r.mirror
    assert [a.dst for a in r.receive(0.1, None, sync.SyncInvite("q")) if isinstance(a, Send)] == ["q0"]  # SyncRequest
    start = sync.SyncStart("q", 0, raw.next_offset, 0, False, [], [], ["q0", "q1"], req=mirror.req)
    assert [a.dst for a in r.receive(0.2, "q0", start) if isinstance(a, Send)] == ["q0"]  # SyncAck
    assert mirror.sync_state == "receiving"

    r.install_view(0.3, View(2, ("q1", "j1")))  # q0 is gone: a promotion starts, no master yet
    assert r.master is None and r.promo is not None
    batch = sync.SyncBatch("q", mirror.req, 0, raw.next_offset, raw.count, raw.data)
    actions = r.receive(0.4, "q0", batch)
    assert [a for a in actions if isinstance(a, Send) and a.dst is None] == []
    assert mirror.sync_state == "receiving" and not r.is_synced
