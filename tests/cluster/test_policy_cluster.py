"""Policies and placement on a real 3-node cluster, driven through mirrorctl.

One cluster, one story (to stay within the time budget):

* a queue no policy matches is declared unmirrored;
* ``set_policy`` exactly 2 (automatic sync): a new queue is declared with
  its master on the declaring node and one mirror, and records the policy;
* the policy goes from exactly 2 to exactly 3: the master's node starts a
  third replica, which joins and synchronises automatically (1000 messages
  already in the queue) -- ``list_queues`` shows it synchronised;
* back to exactly 2: a synchronised surplus mirror is stopped;
* kill the node of the remaining mirror: a new mirror is placed on the third
  node and synchronises;
* ``sync_queue`` / ``cancel_sync_queue`` reach the master and answer;
* a ``nodes`` policy that leaves out the master's node: the master hands
  over to its synchronised mirror there while a client publishes; nothing
  confirmed is lost or duplicated;
* ``clear_policy``: the queue ends unmirrored, its messages intact.
"""

from __future__ import annotations

import pytest
from conftest import LocalCluster, wait_for

from mirrorq.queues.client import InternalClient

pytestmark = pytest.mark.cluster

NODES = ["node1", "node2", "node3"]


admin_port = LocalCluster.admin_port


ctl_json = LocalCluster.ctl_json


def placement_log(c) -> str:
    """What the managers and the queue's replicas logged (shown when a wait fails)."""
    from mirrorq.node.log import read

    keep = (
        "start_mirror",
        "stop_mirror",
        "mirror_started",
        "queue_policy",
        "replica_",
        "master_transfer",
        "mirror_synchronised",
        "promoted",
        "queue_down",
        "declare_failed",
        "placement",
        "node_down",
    )
    lines = []
    for n in NODES:
        for rec in read(str(c.data_dir / n)):
            if rec.get("event", "").startswith(keep):
                lines.append(
                    f"{rec['ts']:.3f} {n} {rec['component']} {rec['event']} "
                    f"{ {k: v for k, v in rec.items() if k not in ('ts', 'node', 'pid', 'component', 'event', 'level')} }"
                )
    return "\n".join(sorted(lines)[-60:])


def wait_until(pred, timeout, what, c=None):
    return wait_for(pred, timeout, what, (lambda: placement_log(c)) if c is not None else None)


ITEMS = ["name", "pid", "slave_pids", "synchronised_slave_pids", "messages", "policy", "state"]


def queue_row(c, capsys, name, node="node1"):
    rows = ctl_json(c, capsys, "-n", node, "list_queues", *ITEMS)
    return next((r for r in rows if r["name"] == name), None)


def test_policy_placement_and_sync_commands(cluster3, capsys):
    c = cluster3
    body = b"m" * 256
    with InternalClient(admin_port(c, "node1")) as cl:
        # no policy: unmirrored (RabbitMQ)
        rec = cl.declare_queue("plain", durable=True)
        assert rec["pid"].startswith("node1/") and rec["slave_pids"] == []

        ctl_json(
            c,
            capsys,
            "set_policy",
            "--apply-to",
            "queues",
            "ha-two",
            "^two\\.",
            '{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}',
        )
        assert [p["name"] for p in ctl_json(c, capsys, "list_policies")] == ["ha-two"]

        rec = cl.declare_queue("two.q", durable=True)
        assert rec["pid"].startswith("node1/") and len(rec["slave_pids"]) == 1 and rec["policy"] == "ha-two"
        cl.open("two.q")
        cl.publish("two.q", [body] * 1000)
        st = cl.wait_confirms("two.q", timeout=20)
        assert st["confirmed"] == 1000 and st["unconfirmed"] == 0

        row = queue_row(c, capsys, "two.q")
        assert row["pid"] == "node1" and row["policy"] == "ha-two" and row["messages"] == 1000
        assert row["state"] == "running" and len(row["slave_pids"]) == 1

        # exactly 2 -> exactly 3: a new mirror joins and syncs automatically
        ctl_json(
            c,
            capsys,
            "set_policy",
            "--apply-to",
            "queues",
            "ha-two",
            "^two\\.",
            '{"ha-mode":"exactly","ha-params":3,"ha-sync-mode":"automatic"}',
        )
        row = wait_until(
            lambda: (lambda r: (r and sorted(r["synchronised_slave_pids"]) == ["node2", "node3"], r))(
                queue_row(c, capsys, "two.q")
            ),
            30,
            "a third, synchronised replica",
            c,
        )
        assert row["pid"] == "node1" and row["messages"] == 1000 and row["state"] == "running"
        (ring,) = [r for r in ctl_json(c, capsys, "ring") if r["name"] == "two.q"]
        assert ring["ring"][0] == {"node": "node1", "member": ring["ring"][0]["member"], "state": "master"}
        assert sorted((m["node"], m["state"]) for m in ring["ring"][1:]) == [
            ("node2", "synchronised"),
            ("node3", "synchronised"),
        ]

        # sync_queue / cancel_sync_queue reach the master
        capsys.readouterr()
        assert c.ctl("sync_queue", "two.q") == 0
        assert "Synchronising queue 'two.q' in vhost '/' ..." in capsys.readouterr().out
        assert c.ctl("cancel_sync_queue", "two.q") == 0
        assert c.ctl("sync_queue", "no-such-queue") == 70
        assert "no queue 'no-such-queue' in vhost '/'" in capsys.readouterr().err

        # back to exactly 2: one synchronised surplus mirror is stopped
        ctl_json(
            c,
            capsys,
            "set_policy",
            "--apply-to",
            "queues",
            "ha-two",
            "^two\\.",
            '{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}',
        )
        row = wait_until(
            lambda: (lambda r: (r and len(r["slave_pids"]) == 1, r))(queue_row(c, capsys, "two.q")),
            20,
            "the surplus mirror to stop",
            c,
        )
        survivor = row["slave_pids"][0]
        spare = next(n for n in NODES if n not in ("node1", survivor))

        # the mirror's node dies: a new mirror is placed on the spare node and syncs
        c.cluster.kill_node(survivor)
        row = wait_until(
            lambda: (lambda r: (r and r["synchronised_slave_pids"] == [spare], r))(queue_row(c, capsys, "two.q")),
            30,
            f"a replacement mirror on {spare}",
            c,
        )
        assert row["slave_pids"] == [spare] and row["messages"] == 1000

        # a nodes policy without the master's node: the master hands over to
        # its synchronised mirror on the listed node and leaves node1, while
        # the client keeps publishing (its unconfirmed publishes go to the new master)
        cl.publish("two.q", [body] * 300)
        ctl_json(
            c,
            capsys,
            "set_policy",
            "--apply-to",
            "queues",
            "ha-two",
            "^two\\.",
            f'{{"ha-mode":"nodes","ha-params":["{spare}"]}}',
        )
        cl.publish("two.q", [body] * 300)
        row = wait_until(
            lambda: (lambda r: (r and r["pid"] == spare and r["slave_pids"] == [], r))(queue_row(c, capsys, "two.q")),
            30,
            f"the master to move to {spare}",
            c,
        )
        st = cl.wait_confirms("two.q", timeout=20)
        assert st["confirmed"] == 1600 and st["unconfirmed"] == 0 and st.get("nacked", 0) == 0, st
        row = wait_until(
            lambda: (lambda r: (r and r["messages"] == 1600, r))(queue_row(c, capsys, "two.q")),
            10,
            "1600 messages on the new master",
            c,
        )
        # the live ring view (one frame) shows the moved master alone in its ring
        (ring,) = [r for r in ctl_json(c, capsys, "ring", "--watch", "--count", "1") if r["name"] == "two.q"]
        assert [(m["node"], m["state"]) for m in ring["ring"]] == [(spare, "master")] and ring["messages"] == 1600

        # the policy cleared: the queue ends unmirrored, messages intact
        ctl_json(c, capsys, "clear_policy", "ha-two")
        row = wait_until(
            lambda: (lambda r: (r and r["slave_pids"] == [] and r["policy"] is None, r))(queue_row(c, capsys, "two.q")),
            20,
            "the queue to be unmirrored",
            c,
        )
        assert row["messages"] == 1600 and row["state"] == "running"
        plain = queue_row(c, capsys, "plain")
        assert plain["slave_pids"] == [] and plain["policy"] is None and plain["messages"] == 0


def test_policy_set_clear_set_cycles_keep_the_queue_serving_every_message(cluster3, capsys):
    """ha-mode all set, cleared, set, cleared, set on a queue holding messages:
    clearing makes both mirrors leave at once, and the one whose view
    proposal lost used to exit still in the view -- no round completed again
    (no confirm, no basic.get answer).  Every cycle must leave the queue
    serving, with every message."""
    c = cluster3
    body = b"c" * 256
    with InternalClient(admin_port(c, "node1")) as cl:
        cl.declare_queue("cycle.q", durable=True)
        cl.open("cycle.q")
        cl.publish("cycle.q", [body] * 500)
        assert cl.wait_confirms("cycle.q", timeout=20)["confirmed"] == 500
        for round_ in range(2):
            ctl_json(
                c,
                capsys,
                "set_policy",
                "--apply-to",
                "queues",
                "ha-cycle",
                "^cycle\\.",
                '{"ha-mode":"all","ha-sync-mode":"automatic"}',
            )
            wait_until(
                lambda: (lambda r: (r and sorted(r["synchronised_slave_pids"]) == ["node2", "node3"], r))(
                    queue_row(c, capsys, "cycle.q")
                ),
                30,
                f"round {round_}: both mirrors synchronised",
                c,
            )
            ctl_json(c, capsys, "clear_policy", "ha-cycle")
            wait_until(
                lambda: (lambda r: (r and r["slave_pids"] == [] and r["state"] == "running", r))(
                    queue_row(c, capsys, "cycle.q")
                ),
                30,
                f"round {round_}: the mirrors gone",
                c,
            )
            # the view holds the master alone: a publish is confirmed (a round completes)
            cl.publish("cycle.q", [body] * 50)
            st = cl.wait_confirms("cycle.q", timeout=20)
            assert st["unconfirmed"] == 0 and st["confirmed"] == 500 + 50 * (round_ + 1), st
        ctl_json(
            c,
            capsys,
            "set_policy",
            "--apply-to",
            "queues",
            "ha-cycle",
            "^cycle\\.",
            '{"ha-mode":"all","ha-sync-mode":"automatic"}',
        )
        wait_until(
            lambda: (lambda r: (r and sorted(r["synchronised_slave_pids"]) == ["node2", "node3"], r))(
                queue_row(c, capsys, "cycle.q")
            ),
            30,
            "mirrored again",
            c,
        )
        cl.publish("cycle.q", [body] * 50)
        assert cl.wait_confirms("cycle.q", timeout=20)["confirmed"] == 650
        cl.consume("cycle.q", prefetch=100)
        got = cl.fetch_until("cycle.q", 650, timeout=30, idle=10.0)
    seqs = [int(mid.split("|")[2]) for mid, _b, _r, _e in got]
    assert sorted(set(seqs)) == list(range(1, 651)), f"{len(set(seqs))} distinct of 650"


def test_a_mirrored_priority_queue_keeps_its_order_across_a_failover(cluster3, capsys):
    """x-max-priority on a queue mirrored on every node: the mirrors order
    their ready messages by priority exactly as the master does, so after
    the master's node is killed the new master hands them out highest
    priority first (FIFO within a priority), none lost."""
    pika = pytest.importorskip("pika")
    c = cluster3
    ctl_json(
        c,
        capsys,
        "set_policy",
        "--apply-to",
        "queues",
        "ha-prio",
        "^prio\\.",
        '{"ha-mode":"all","ha-sync-mode":"automatic"}',
    )
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port, connection_attempts=1))
    try:
        ch = conn.channel()
        ch.queue_declare("prio.q", durable=True, arguments={"x-max-priority": 9})
        ch.confirm_delivery()
        sent = [(i, (i * 7) % 11) for i in range(60)]  # priorities 0..10: 10 counts as 9
        for i, p in sent:
            ch.basic_publish("", "prio.q", b"%d" % i, pika.BasicProperties(delivery_mode=2, priority=p))
    finally:
        conn.close()
    row = wait_until(
        lambda: (lambda r: (r and sorted(r["synchronised_slave_pids"]) == ["node2", "node3"], r))(
            queue_row(c, capsys, "prio.q")
        ),
        30,
        "both mirrors synchronised",
        c,
    )
    master = row["pid"]
    assert c.ctl("kill_node", master) == 0
    survivor = next(n for n in NODES if n != master)
    wait_until(
        lambda: (lambda r: (r and r["pid"] not in (master, None) and r["state"] == "running", r))(
            queue_row(c, capsys, "prio.q", node=survivor)
        ),
        30,
        "a new master",
        c,
    )
    port = c.amqp_base_port + NODES.index(survivor)
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, connection_attempts=1))
    try:
        ch = conn.channel()
        got = []
        while True:
            m, _props, body = ch.basic_get("prio.q", auto_ack=True)
            if m is None:
                break
            got.append(int(body))
    finally:
        conn.close()
    want = [i for i, _ in sorted(sent, key=lambda ip: (-min(ip[1], 9), ip[0]))]
    assert got == want
