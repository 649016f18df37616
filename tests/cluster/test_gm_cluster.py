"""GM ring on a real 3-node cluster: one GMMemberActor per node, the group
founded through the registry by two members, the third joining through the
registry, then 100k broadcasts from the two founders while the joiner's node
is kill -9'd mid-way.

Checked on the survivors: the view without the dead member was installed;
each delivered exactly 1..50000 of each origin, in order, with no gap and no
duplicate (the actor records any seq that is not last + 1); their per-origin
rolling digests of (seq, payload hash) are equal, so they delivered the same
payloads in the same order; every broadcast was confirmed at its origin,
once, in order; the cores counted no anomaly.  Polls with deadlines, no
sleeps that stand for waiting on a result.
"""

from __future__ import annotations

import pytest

from mirrorq.admin.cluster import wait_until as poll
from mirrorq.gm.actor import ask_info, ask_ok, ask_report, spawn_member
from mirrorq.gm.messages import GMBroadcastMany, GMCreateGroup, GMJoinGroup
from mirrorq.gm.shell import parse_member_name
from mirrorq.node.client import NodeClient

pytestmark = pytest.mark.cluster

PER_ORIGIN = 50_000


def test_ring_survives_kill9_of_a_member_node_mid_stream(cluster3):
    c = cluster3
    nodes = ["node1", "node2", "node3"]
    clients = {n: NodeClient(int(c.cluster.pid_info(n)["admin_port"])) for n in nodes}
    try:
        asys = clients["node1"].asys
        addr = {n: spawn_member(clients[n].asys, "gm-test", n) for n in nodes}
        name = {n: ask_info(asys, addr[n]).name for n in nodes}
        for n in nodes:
            ref = parse_member_name(name[n])
            assert ref.node == n and ref.host == "127.0.0.1"

        # found the group with two members through the registry ...
        ask_ok(asys, addr["node1"], GMCreateGroup((name["node1"], name["node2"])))
        poll(
            lambda: all(ask_info(asys, addr[n]).view == (1, [name["node1"], name["node2"]]) for n in nodes[:2]),
            20,
            "the founding view at both founders",
        )
        # ... and the third joins through the registry (version + 1, appended)
        ask_ok(asys, addr["node3"], GMJoinGroup())
        full = [name[n] for n in nodes]
        poll(lambda: all(ask_info(asys, addr[n]).view == (2, full) for n in nodes), 20, "the view with the joiner")

        # 2 originators, 50k each in two halves; node3's member only relays.
        # The second half is asked for only after the kill, so the kill lands
        # mid-stream however fast the ring runs.
        half = PER_ORIGIN // 2
        for n in nodes[:2]:
            ask_ok(asys, addr[n], GMBroadcastMany(half, size=100, window=4000, chunk=400))
        # kill -9 node3 once it has delivered a good part of the first half
        before = poll(
            lambda: (r := ask_report(asys, addr["node3"])) and sum(d[0] for d in r.delivered.values()) >= 20_000 and r,
            30,
            "node3's member delivering 20k",
            step=0.02,
        )
        assert c.cluster.kill_node("node3")
        for n in nodes[:2]:
            ask_ok(asys, addr[n], GMBroadcastMany(PER_ORIGIN - half, size=100, window=4000, chunk=400))
        assert not before.errors, before.errors

        # the survivors drop the dead member from the view and finish the stream
        final = poll(
            lambda: (
                (rs := {n: ask_report(asys, addr[n]) for n in nodes[:2]})
                and all(r.confirmed == PER_ORIGIN for r in rs.values())
                and rs
            ),
            40,
            "every broadcast confirmed at both origins",
            step=0.1,
        )
        survivors = [name["node1"], name["node2"]]
        for n, r in final.items():
            assert not r.removed
            assert r.view[1] == survivors and r.view[0] >= 3, f"{n}: view {r.view}"
            assert not r.errors, f"{n}: {r.errors}"
            assert r.published == r.confirmed == PER_ORIGIN
            assert r.stats["anomalies"] == 0, f"{n}: {r.stats}"
            for o in survivors:
                count, last, _ = r.delivered[o]
                assert count == last == PER_ORIGIN, f"{n} delivered {count} (last {last}) of {o}"
        assert final["node1"].delivered == final["node2"].delivered
        # what the dead member had delivered is a prefix of the same streams
        for o, (count, last, _) in before.delivered.items():
            assert o in survivors and count == last <= PER_ORIGIN
    finally:
        for cl in clients.values():
            cl.close()
