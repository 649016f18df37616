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
  (packets dropped silently / answered with TCP resets), healed after ``hold``;
* ``partition-oneway``: an asymmetric cut: what the node sends to the others
  is dropped, what they send still arrives;
* ``flap``: the node cut silently for :data:`FLAP_PERIOD` seconds, healed as
  long, again and again for ``hold``.

:func:`long_schedule` is the partitions issue's: cuts of a minute or more,
silent and with resets, of the master's node and of a mirror's, an
asymmetric cut, pauses of 30-60 s and a flapping link, then random long
faults to fill the time.

Targets: ``master`` (the queue's master's node), ``mirror`` (a node holding a
mirror), ``consumer`` (the node the consumer is connected to), ``publisher``,
``any``.  After each step the schedule waits ``quiet`` seconds with no fault.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FAULTS = ("kill", "stop", "restart", "pause", "partition-drop", "partition-reset", "partition-oneway", "flap")
#: a flapping link's cut and healed phases (seconds each)
FLAP_PERIOD = 2.0
TARGETS = ("master", "mirror", "consumer", "publisher", "any")


@dataclass(frozen=True)
class Step:
    fault: str
    target: str
    hold: float  # seconds the fault lasts (0 for restart)
    quiet: float  # seconds with no fault after it ends


def random_schedule(
    seed: int,
    duration: float,
    faults: tuple[str, ...] = FAULTS,
    hold: tuple[float, float] = (3.0, 12.0),
    quiet: tuple[float, float] = (4.0, 10.0),
) -> list[Step]:
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


def acceptance_schedule(
    seed: int, hold: tuple[float, float] = (4.0, 8.0), quiet: tuple[float, float] = (5.0, 8.0)
) -> list[Step]:
    """The standard fault run: kills (one of them of the consumer's node,
    one of the master's), restarts, a silent-drop partition of the master and
    one of a mirror, in an order and with durations drawn from ``seed``."""
    rng = random.Random(seed)
    required = [
        ("kill", "consumer"),
        ("kill", "master"),
        ("restart", "any"),
        ("partition-drop", "master"),
        ("partition-drop", "mirror"),
    ]
    rng.shuffle(required)
    return [
        Step(f, t, 0.0 if f == "restart" else round(rng.uniform(*hold), 2), round(rng.uniform(*quiet), 2))
        for f, t in required
    ]


def long_schedule(seed: int, duration: float, quiet: tuple[float, float] = (10.0, 15.0)) -> list[Step]:
    """Long faults for about ``duration`` seconds: first (in an order drawn
    from ``seed``) a silent and a reset cut of 60-90 s of the master's node
    and of a mirror's, a one-way cut of the master's node, pauses of 30-60 s
    of the master's and of a mirror's node and a minute of flapping; then
    random faults of 30-90 s (cuts of every kind and pauses) until the
    duration is filled."""
    rng = random.Random(seed)
    required = [
        ("partition-drop", "master"),
        ("partition-reset", "master"),
        ("partition-drop", "mirror"),
        ("partition-reset", "mirror"),
        ("partition-oneway", "master"),
        ("pause", "master"),
        ("pause", "mirror"),
        ("flap", "master"),
    ]
    rng.shuffle(required)
    holds = {"pause": (30.0, 60.0), "flap": (60.0, 60.0)}
    steps, total = [], 0.0
    for f, t in required:
        h = round(rng.uniform(*holds.get(f, (60.0, 90.0))), 2)
        q = round(rng.uniform(*quiet), 2)
        steps.append(Step(f, t, h, q))
        total += h + q
    extra = ("partition-drop", "partition-reset", "partition-oneway", "pause", "flap")
    while total < duration:
        f = rng.choice(extra)
        h = round(rng.uniform(30.0, 90.0), 2)
        q = round(rng.uniform(*quiet), 2)
        steps.append(Step(f, rng.choice(("master", "mirror", "any")), h, q))
        total += h + q
    return steps


def parse(text: str) -> list[Step]:
    """``"kill:master:5:5,partition-drop:mirror:6:5"`` -> steps (for replaying a run by hand)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        f, t, h, q = part.split(":")
        if f not in FAULTS or t not in TARGETS:
            raise ValueError(f"bad step {part!r}: fault in {FAULTS}, target in {TARGETS}")
        out.append(Step(f, t, float(h), float(q)))
    return out
