"""Sync of a restarted mirror on a real 3-node cluster (issue 6, "Real cluster").

One cluster and one 100k-message queue for the module (loading it is most
of the cost), two stories on it:

* **manual sync while the queue serves** -- policy ``ha-mode: all``,
  ``ha-sync-mode: manual``.  kill -9 a mirror's node, publish 10k while it
  is down, restart it: placement gives the node its mirror back, which
  reopens its store and is *unsynchronised* in ``list_queues``; the master
  holds it waiting (``sync_queue`` finds it among the waiting mirrors and no
  transfer ran before).  ``sync_queue`` starts the transfer; while the
  master reports it ``syncing N`` (and ``list_queues`` says ``syncing``), a
  publisher on node2 keeps getting confirms and a consumer on node1 keeps
  getting deliveries; then ``list_queues`` shows the mirror synchronised and
  it holds exactly what the master holds (offsets and message count, asked
  of the mirror itself).  ``ha-sync-batch-size: 20`` makes the transfer
  hundreds of round trips, so it outlasts the test's sampling windows.
* **delta** -- ``ha-sync-mode: automatic``.  A mirror restarted after 1000
  new messages receives those 1000 records, not the 100k the queue holds:
  the master's ``sync_records_sent`` moves by exactly the records appended
  while it was down, and the new mirror's ``sync_records_received`` is 1000.

Bodies are 15 bytes: sync moves log *records*, so what these tests check
(records transferred, states, serving during sync) does not depend on body
size, and small bodies keep loading 100k messages within the CI budget
(~10 s here); timing 100k x 1 KiB is the issue's benchmark item.  The third
acceptance item (automatic sync of a new mirror after a policy change from
exactly 2 to exactly 3) is covered by ``test_policy_cluster.py`` (1000
messages, the third replica ends in ``synchronised_slave_pids``) and is not
repeated here.

Each restart currently costs ~15 s before the mirror is back: the master's
node asks the restarted node's *previous* queue manager (still registered)
to start it, and placement repeats a lost start only after its retry time.
"""

from __future__ import annotations

import json
import time

import conftest
import pytest

from mirrorq.classic.actor import ReplicaInfo, ReplicaInfoQuery
from mirrorq.gm.shell import member_address, parse_member_name
from mirrorq.node.client import NodeClient
from mirrorq.node.posting import ToReplica
from mirrorq.queues.client import InternalClient

pytestmark = pytest.mark.cluster

NODES = ["node1", "node2", "node3"]
QUEUE = "sync.q"
LOADED = 100_000
#: the mirror we kill (node1 declares, so it hosts the master: client-local)
VICTIM = "node3"
POLICY = "ha-sync"
PATTERN = "^sync\\."
#: records per sync batch in the manual-sync story: 10k records are ~500 batches
SYNC_BATCH = 20


def body(i: int) -> bytes:
    return b"%015d" % i


admin_port = conftest.LocalCluster.admin_port


ctl_json = conftest.LocalCluster.ctl_json


def set_policy(c, capsys, mode: str, **extra) -> None:
    definition = {"ha-mode": "all", "ha-sync-mode": mode, **extra}
    ctl_json(c, capsys, "set_policy", "--apply-to", "queues", POLICY, PATTERN, json.dumps(definition))


ITEMS = ["name", "pid", "slave_pids", "synchronised_slave_pids", "messages", "policy", "state"]


def queue_row(c, capsys, node="node1"):
    rows = ctl_json(c, capsys, "-n", node, "list_queues", *ITEMS)
    return next((r for r in rows if r["name"] == QUEUE), None)


def diagnostics(c) -> str:
    """What the nodes logged about the queue, and any traceback (shown when a wait fails)."""
    from mirrorq.node.log import read

    keep = (
        "start_mirror",
        "stop_mirror",
        "mirror_started",
        "replica_",
        "sync_",
        "mirror_synchronised",
        "store_reset",
        "promoted",
        "queue_down",
        "queue_definition",
        "master_known",
    )
    lines = []
    for n in NODES:
        for rec in read(str(c.data_dir / n)):
            if rec.get("event", "").startswith(keep):
                rest = {k: v for k, v in rec.items() if k not in ("ts", "node", "pid", "component", "event", "level")}
                lines.append(f"{rec['ts']:.3f} {n} {rec['component']} {rec['event']} {rest}")
    out = ["\n".join(sorted(lines)[-60:])]
    for f in sorted(c.data_dir.glob("*/daemon.out")):
        text = f.read_text(errors="replace")
        if "Traceback" in text:
            out.append(f"--- {f.parent.name}/daemon.out:\n" + text[text.index("Traceback") :][-3000:])
    return "\n".join(out)


def wait_until(pred, timeout, what, c):
    return conftest.wait_for(pred, timeout, what, lambda: diagnostics(c))


def member_on(info: dict, node: str) -> str | None:
    """The master's view: the mirror member hosted on ``node``, if any."""
    return next((m for m in info["sync"] if parse_member_name(m).node == node), None)


def replica_info(c, member: str) -> dict:
    """A replica's own info (asked of its actor directly, not through the master)."""
    nc = NodeClient(admin_port(c, parse_member_name(member).node))
    try:
        r = nc.asys.ask(member_address(member), ToReplica(member, ReplicaInfoQuery()), 10)
    finally:
        nc.close()
    assert isinstance(r, ReplicaInfo), f"replica {member} did not answer its info: {r!r}"
    return r.info


def all_synchronised(c, capsys):
    row = queue_row(c, capsys)
    ok = (
        row is not None
        and row["pid"] == "node1"
        and sorted(row["slave_pids"]) == ["node2", "node3"]
        and sorted(row["synchronised_slave_pids"]) == ["node2", "node3"]
    )
    return ok, row


def restart_victim(c) -> None:
    if not c.cluster.is_running(VICTIM):
        c.cluster.start_node(VICTIM)
    c.cluster.wait_all_up(NODES, timeout=30)


@pytest.fixture(scope="module")
def loaded():
    """A 3-node cluster whose queue ``sync.q`` (master on node1, mirrors on
    node2 and node3, all synchronised) holds LOADED confirmed messages."""
    with conftest.running_cluster() as c:
        # automatic while loading: right after "cluster start" a node's manager
        # may not know every peer's manager yet, so the declare can get fewer
        # founders and placement adds the others as joiners, which must sync
        assert (
            c.ctl("set_policy", "--apply-to", "queues", POLICY, PATTERN, '{"ha-mode":"all","ha-sync-mode":"automatic"}')
            == 0
        )
        with InternalClient(admin_port(c, "node1")) as cl:
            rec = cl.declare_queue(QUEUE, durable=True)
            assert parse_member_name(rec["pid"]).node == "node1", rec
            cl.open(QUEUE)

            def mirrors_synchronised():
                sync = cl.info(QUEUE)["sync"]
                nodes = sorted(parse_member_name(m).node for m, st in sync.items() if st == "synchronised")
                return nodes == ["node2", "node3"], sync

            wait_until(mirrors_synchronised, 30, "the empty queue's mirrors on node2 and node3", c)
            for i in range(0, LOADED, 5000):
                cl.publish(QUEUE, [body(j) for j in range(i, i + 5000)])
            st = cl.wait_confirms(QUEUE, timeout=60)
            assert st["confirmed"] == LOADED and st["unconfirmed"] == 0 and st["nacked"] == 0, st
        yield c


def same_as_master(c, client, member):
    """Poll until the replica ``member`` holds what the master holds (a quiet queue)."""

    def same():
        master = client.info(QUEUE)
        mirror = replica_info(c, member)
        return all(mirror[k] == master[k] for k in ("next_offset", "messages")), (master, mirror)

    return wait_until(same, 10, f"{member} to hold what the master holds", c)


def test_manual_sync_of_a_restarted_mirror_while_the_queue_serves(loaded, capsys):
    c = loaded
    down_published = 10_000
    # a small batch size makes the transfer hundreds of round trips: it outlasts
    # several sampling windows (each a few round trips of the test's own)
    set_policy(c, capsys, "manual", **{"ha-sync-batch-size": SYNC_BATCH})
    wait_until(lambda: all_synchronised(c, capsys), 30, "every mirror synchronised", c)

    with InternalClient(admin_port(c, "node2")) as pub:
        pub.open(QUEUE)
        before = pub.info(QUEUE)
        assert before["messages"] >= LOADED
        old_member = member_on(before, VICTIM)
        assert old_member is not None, before

        # kill -9 the mirror's node; publish while it is down
        c.cluster.kill_node(VICTIM)

        published = pub.confirms(QUEUE)["published"]
        for i in range(0, down_published, 2000):
            pub.publish(QUEUE, [body(j) for j in range(i, i + 2000)])
        st = pub.wait_confirms(QUEUE, timeout=30)
        assert st["confirmed"] == published + down_published and st["unconfirmed"] == 0, st
        info = pub.info(QUEUE)
        assert old_member not in info["sync"], f"the dead mirror is still in the view: {info['sync']}"

        # restart it: placement gives node3 its mirror back, unsynchronised (manual)
        restart_victim(c)

        def rejoined():
            row = queue_row(c, capsys)
            ok = (
                row is not None
                and sorted(row["slave_pids"]) == ["node2", "node3"]
                and row["synchronised_slave_pids"] == ["node2"]
                and row["state"] == "running"
            )
            return ok, row

        row = wait_until(rejoined, 30, "node3's mirror back, unsynchronised", c)
        assert row["pid"] == "node1" and row["policy"] == POLICY
        info = pub.info(QUEUE)
        member = member_on(info, VICTIM)
        assert member is not None and member != old_member, info["sync"]
        assert info["sync"][member] == "unsynchronised", info["sync"]
        sent_before = info["sync_records_sent"]

        with InternalClient(admin_port(c, "node1")) as con:
            con.open(QUEUE)
            # prefetch 50: the story consumes a few thousand at most, so the queue
            # still holds LOADED for the delta story (this module shares it)
            con.consume(QUEUE, prefetch=50)
            delivered = len(con.fetch_until(QUEUE, 1, timeout=10))
            assert delivered >= 1, "the consumer got nothing before the sync"

            # sync_queue: the master invites the mirror it holds waiting (a
            # mirror whose request has not reached the master yet is not
            # invited: ask again until it is)
            def invited():
                res = ctl_json(c, capsys, "sync_queue", QUEUE)["result"]
                assert member not in res["running"], f"a transfer ran before sync_queue (manual mode): {res}"
                return member in res["invited"], res

            wait_until(invited, 15, "sync_queue to find the mirror waiting", c)

            # the queue serves while the transfer runs.  Each window lies between
            # two readings of the master's sync state; inside it a publish is
            # confirmed, and a delivery arrives after the consumer acked
            # everything it held (so it was sent inside the window).
            windows = []  # (state before, confirmed in window, delivered in window, state after)
            listed = None
            deadline = time.monotonic() + 30
            state = pub.info(QUEUE)["sync"].get(member)
            while state != "synchronised" and time.monotonic() < deadline:
                prev = state
                delivered += len(con.fetch(QUEUE, 5000))
                before = pub.confirms(QUEUE)["confirmed"]
                pub.publish(QUEUE, [body(j) for j in range(100)])
                confirmed = pub.wait_confirms(QUEUE, timeout=10)["confirmed"] - before
                fresh = len(con.fetch_until(QUEUE, 1, timeout=10))
                delivered += fresh
                state = pub.info(QUEUE)["sync"].get(member)
                windows.append((prev, confirmed, fresh, state))
                if listed is None and state.startswith("syncing"):
                    listed = queue_row(c, capsys)["state"]  # list_queues, read while syncing
                    state = pub.info(QUEUE)["sync"].get(member)
                    if not state.startswith("syncing"):
                        listed = None  # the transfer may have ended before list_queues read it
            assert state == "synchronised", f"not synchronised after 30s: {windows[-3:]}\n{diagnostics(c)}"
            during = [w for w in windows if w[0].startswith("syncing") and w[3].startswith("syncing")]
            assert during, f"no window lay inside the transfer: {windows}"
            assert all(w[1] >= 100 and w[2] >= 1 for w in during), (
                f"the queue stopped serving during the sync: {during}"
            )
            progress = [int(s.split()[1]) for w in windows for s in (w[0], w[3]) if s.startswith("syncing")]
            assert progress == sorted(progress) and progress[-1] > progress[0], (
                f"the transfer made no progress: {windows}"
            )
            if listed is not None:  # list_queues read while the master reported the transfer
                assert listed.startswith("syncing "), f"list_queues state during the sync: {listed!r}"

        row = wait_until(lambda: all_synchronised(c, capsys), 30, "list_queues to show node3 synchronised", c)
        assert row["state"] == "running"

        # the synchronised mirror holds what the master holds
        st = pub.wait_confirms(QUEUE, timeout=30)
        assert st["unconfirmed"] == 0 and st["nacked"] == 0, st
        master, mirror = same_as_master(c, pub, member)
        assert mirror["role"] == "slave" and mirror["sync"] == "synchronised", mirror
        sent = master["sync_records_sent"] - sent_before
        assert down_published <= sent < LOADED, f"the restarted mirror got {sent} records"


def test_restarted_mirror_receives_only_the_delta(loaded, capsys):
    c = loaded
    delta = 1000
    set_policy(c, capsys, "automatic")
    restart_victim(c)
    wait_until(lambda: all_synchronised(c, capsys), 30, "every mirror synchronised", c)

    with InternalClient(admin_port(c, "node2")) as pub:
        pub.open(QUEUE)
        info = pub.info(QUEUE)
        assert info["messages"] >= LOADED and info["consumers"] == 0, info
        old_member = member_on(info, VICTIM)
        assert old_member is not None, info["sync"]
        # a quiet queue: node3's mirror holds the master's log, up to next0
        master, _ = same_as_master(c, pub, old_member)
        sent0, next0 = master["sync_records_sent"], master["next_offset"]

        c.cluster.kill_node(VICTIM)

        published = pub.confirms(QUEUE)["published"]
        pub.publish(QUEUE, [body(j) for j in range(delta)])
        st = pub.wait_confirms(QUEUE, timeout=30)
        assert st["confirmed"] == published + delta and st["unconfirmed"] == 0, st
        restart_victim(c)

        def synced():
            # node3's NEW mirror in the master's view, and the registry's row
            # saying it is synchronised (a row read before the master wrote
            # the view without the old mirror would say so of the old one)
            now_on = member_on(pub.info(QUEUE), VICTIM)
            ok, row = all_synchronised(c, capsys)
            return ok and now_on is not None and now_on != old_member, row

        wait_until(synced, 30, "node3's restarted mirror synchronised", c)
        info = pub.info(QUEUE)
        member = member_on(info, VICTIM)
        sent = info["sync_records_sent"] - sent0
        lacked = info["next_offset"] - next0
        assert lacked == delta, f"{lacked} records appended while node3 was down, expected {delta}"
        assert sent == lacked, f"the master sent {sent} records to the restarted mirror; it lacked {lacked}"
        _, mirror = same_as_master(c, pub, member)
        assert mirror["sync_records_received"] == delta, mirror
        assert mirror["messages"] >= LOADED, mirror
