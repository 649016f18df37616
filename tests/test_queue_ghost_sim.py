"""No ghost consumers: a consumer whose front end dies with its node is
dropped by the master and its unacked messages go to a live consumer.

The front end's death reaches the master as ``dst_down`` (the replica
actor's outbox gives up on the dead front end's address after probing it
when the node is reported down).  Checked under the simulator: the first
consumer stops acking and dies holding unacked messages; after ``dst_down``
the master has no consumer from it, no message unacked by it, and a second
consumer gets every published message (those the dead one held come back
redelivered); a mirror promoted afterwards has no ghost either.
"""

from __future__ import annotations

import random

import pytest
from queue_sim_support import QUEUE, ConsumerNode, build


@pytest.mark.parametrize("seed", range(20), ids=lambda s: f"seed={s}")
def test_dead_front_end_releases_its_consumers_and_unacked_messages(seed):
    rng = random.Random(seed)
    total = 200
    sim, names = build(seed, replicas=3, total=total)
    pub = sim.core("pub")
    con = sim.core("con")
    # the consumer holds its prefetch unacked, then its node dies
    assert sim.run_until(lambda: len(con.received) >= 10, timeout=10)
    held = {d.msg_id for d in con.to_ack}  # received, not acked yet: it never acks those
    acked = {d.msg_id for _, d in con.received} - held  # settled before it died
    con.to_ack.clear()
    sim.kill("con")
    master = sim.core("q0").replica
    assert master.bq.unacked_count > 0 and master.consumers
    sim.call("q0", "dst_down", "con")
    assert not any(k[0][0] == "con" for k in master.consumers), "ghost consumer left"
    sim.add_node("con2", lambda n, d: ConsumerNode(n, "q0", rng))
    con2 = sim.core("con2")

    def drained():
        got = {d.msg_id for _, d in con2.received} | acked
        return pub.done() and all(f"pub|1|{s}" in got for s in pub.confirmed) and master.bq.message_count == 0

    assert sim.run_until(drained, timeout=60), (
        f"not drained: {len({d.msg_id for _, d in con2.received})} of {len(pub.confirmed)}; {master.info()}"
    )
    again = [d for _, d in con2.received if d.msg_id in held]
    assert held and {d.msg_id for d in again} == held and all(d.redelivered for d in again)
    # every replica agrees: the ghost's removal was replicated
    assert sim.run_until(
        lambda: all(not any(k[0][0] == "con" for k in sim.core(n).replica.consumers) for n in names), timeout=5
    )
    assert QUEUE == master.spec.name
