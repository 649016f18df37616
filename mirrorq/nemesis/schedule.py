"""The nemesis' schedule: which fault, on which kind of target, when and for
how long.  Pure and deterministic from a seed (the same seed gives the same
steps); the runner resolves target kinds to nodes when a step starts (the
master is whoever is master then), which is the only non-deterministic part.

Faults (one node at a time, so a 3-node cluster keeps its majority):

* ``kill``: SIGKILL of the node's process group, restarted after ``hold``;
* ``stop``: graceful stop (the node announces its leave), restarted after ``hold``;
* ``restart``: graceful stop and immediate start;
* ``pause``: SIGSTOP of the process group, SIGCONT after ``hold``;
* ``partition-drop`` / ``partition-reset``: the node cut from all others
  (packets dropped silently / answered with TCP resets), healed after ``hold``.

Targets: ``master`` (the queue's master's node), ``mirror`` (a node holding a
mirror), ``consumer`` (the node the consumer is connected to), ``publisher``,
``any``.  After each step the schedule waits ``quiet`` seconds with no fault.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FAULTS = ("kill", "stop", "restart", "pause", "partition-drop", "partition-reset")
TARGETS = ("master", "mirror", "consumer", "publisher", "any")


@dataclass(frozen=True)
class Step:
    fault: str
    target: str
    hold: float   # seconds the fault lasts (0 for restart)
    quiet: float  # seconds with no fault after it ends


def random_schedule(seed: int, duration: float, faults: tuple[str, ...] = FAULTS,
                    hold: tuple[float, float] = (3.0, 12.0), quiet: tuple[float, float] = (4.0, 10.0)) -> list[Step]:
    """Steps whose holds and quiets add up to about ``duration`` seconds."""
    rng = random.Random(seed)
    steps, total = [], 0.0
    while total < duration:
        f = rng.choice(faults)
        h = 0.0 if f == "restart" else round(rng.uniform(*hold), 2)
        q = round(rng.uniform(*quiet), 2)
        steps.append(Step(f, rng.choice(TARGETS), h, q))
        total += h + q
    return steps


def acceptance_schedule(seed: int, hold: tuple[float, float] = (4.0, 8.0),
                        quiet: tuple[float, float] = (5.0, 8.0)) -> list[Step]:
    """Issue #16's acceptance run: kills (one of them of the consumer's node,
    one of the master's), restarts, a silent-drop partition of the master and
    one of a mirror, in an order and with durations drawn from ``seed``."""
    rng = random.Random(seed)
    required = [("kill", "consumer"), ("kill", "master"), ("restart", "any"),
                ("partition-drop", "master"), ("partition-drop", "mirror")]
    rng.shuffle(required)
    return [Step(f, t, 0.0 if f == "restart" else round(rng.uniform(*hold), 2), round(rng.uniform(*quiet), 2))
            for f, t in required]


def parse(text: str) -> list[Step]:
    """``"kill:master:5:5,partition-drop:mirror:6:5"`` -> steps (for replaying a run by hand)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        f, t, h, q = part.split(":")
        if f not in FAULTS or t not in TARGETS:
            raise ValueError(f"bad step {part!r}: fault in {FAULTS}, target in {TARGETS}")
        out.append(Step(f, t, float(h), float(q)))
    return out
