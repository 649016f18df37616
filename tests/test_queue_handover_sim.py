"""Master hand-over under the simulator: a live master leaves in favour of a
named synchronised mirror while a publisher and a consumer keep working.

Every seed: 3 or 4 replicas, the master ``q0`` hands over to a mirror chosen
at random (often not the oldest, which the plain promotion would pick) at a
random moment; once it has proposed the view without itself it exits (the
actor's exit).  Sometimes the chosen mirror dies during the hand-over: the
oldest synchronised survivor takes over instead.  Checked on top of
test_queue_sim's checks (nothing confirmed lost, no double enqueue,
replicated acks final, order, identical survivors): the new master is the
chosen mirror unless it died, and the registry saw exactly one change of
master.

Replay: ``pytest 'tests/test_queue_handover_sim.py::test_hand_over[seed=3]'``.
"""

from __future__ import annotations

import random

import pytest
from queue_sim_support import build
from test_queue_sim import _check

from mirrorq.classic.replica import HandingOver, HandOverRefused

SEEDS = 120


@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda s: f"seed={s}")
def test_hand_over(seed, tmp_path):
    rng = random.Random(seed)
    replicas = rng.choice([3, 4])
    sim, names = build(
        seed,
        replicas=replicas,
        total=rng.choice([150, 300]),
        fifo=rng.random() < 0.5,
        directory=str(tmp_path) if rng.random() < 0.5 else None,
    )
    target = rng.choice(names[1:])
    kill_target = rng.random() < 0.2
    killed: list[str] = []

    def start(s):
        s.call("q0", "hand_over", target)
        if kill_target:

            def die(s2):
                s2.kill(target)
                killed.append(target)
                for n in names:
                    if n != target:
                        s2.schedule(
                            s2.now + rng.uniform(0.005, 0.05),
                            lambda s3, n=n: n in s3.alive() and s3.call(n, "member_down", target),
                        )

            s.schedule(s.now + rng.uniform(0.0, 0.01), die)

    sim.schedule(rng.uniform(0.02, 0.3), start)

    def exited():
        return any(isinstance(ev, HandingOver) for _, n, ev in sim.emitted if n == "q0")

    assert sim.run_until(exited, timeout=10), [sim.core(n).replica.info() for n in names if n in sim.alive()]
    # the old master's process exits once it asked for the view without itself
    sim.schedule(sim.now + rng.uniform(0.0, 0.02), lambda s: (s.kill("q0"), killed.append("q0")))
    assert sim.run_until(
        lambda: (
            "q0" in killed
            and sim.core("registry").master_history[-1] != "q0"
            and any(sim.core(n).replica.is_master for n in names if n in sim.alive())
        ),
        timeout=10,
    ), "nobody took over"
    _check(sim, list(names), sim.core("pub").total, killed)
    reg = sim.core("registry")
    new = reg.master_history[1:]
    if not kill_target:
        assert new == [target], f"masters after q0: {new}, wanted {target}"
    else:
        assert new and new[0] != "q0" and new[-1] in sim.alive()
    assert not any(isinstance(ev, HandOverRefused) for _, n, ev in sim.emitted)


def test_hand_over_is_refused_to_an_unsynchronised_mirror_or_by_a_mirror(tmp_path):
    policy = {"ha-sync-mode": "manual"}
    sim, names = build(11, replicas=2, total=50, directory=str(tmp_path), policy=policy)
    sim.kill("con")  # the queue keeps messages: a new mirror stays unsynchronised
    assert sim.run_until(lambda: sim.core("pub").done(), timeout=10)
    from queue_sim_support import ReplicaNode

    sim.add_node(
        "j1", lambda n, d: ReplicaNode(n, None, directory=f"{tmp_path}/j1", joining=True, policy=policy, disk=d)
    )
    assert sim.run_until(lambda: sim.core("j1").replica.master == "q0", timeout=10)
    sim.call("q0", "hand_over", "j1")
    sim.call("q1", "hand_over", "q0")
    sim.call("q0", "hand_over", "nobody")
    sim.run_for(0.5)
    refused = [(n, ev.reason) for _, n, ev in sim.emitted if isinstance(ev, HandOverRefused)]
    assert refused == [
        ("q0", "the target is not synchronised"),
        ("q1", "this replica is not the master"),
        ("q0", "the target is not a mirror in the master's view"),
    ]
    assert sim.core("q0").replica.is_master and sim.core("registry").master_history == ["q0"]
