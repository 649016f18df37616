"""The node agent's registry actions held while the disk refuses a persist
stay bounded (mirrorq.node.agent.trim_held)."""

from __future__ import annotations

from mirrorq.node.agent import trim_held
from mirrorq.sansio import CancelTimer, Emit, Persist, Send, SetTimer


def _heartbeats(n: int) -> list:
    """What a registry leader's heartbeat timer makes, n times over: a send to
    each peer and the timer set again."""
    out: list = []
    for k in range(n):
        out += [Send("node2", ("append", k)), Send("node3", ("append", k)), SetTimer("heartbeat", 0.1)]
    return out


def test_timers_keep_their_last_setting_and_the_oldest_sends_go_past_the_bound():
    held = [Persist(), Emit("committed-1"), *_heartbeats(1000), CancelTimer("election"), SetTimer("election", 0.7)]
    kept, dropped = trim_held(held, 500)
    assert len(kept) == 500
    timers = [a for a in kept if isinstance(a, (SetTimer, CancelTimer))]
    assert timers == [SetTimer("heartbeat", 0.1), SetTimer("election", 0.7)]
    assert kept[:2] == [Persist(), Emit("committed-1")]  # persists and events all stay, in order
    sends = [a for a in kept if isinstance(a, Send)]
    assert dropped == 2000 - len(sends)
    # the newest sends stay, in order
    assert sends == [a for a in held if isinstance(a, Send)][-len(sends) :]


def test_under_the_bound_only_timers_are_collapsed():
    held = _heartbeats(3)
    kept, dropped = trim_held(held, 100)
    assert dropped == 0
    assert kept == [a for a in held if isinstance(a, Send)] + [SetTimer("heartbeat", 0.1)]


def test_events_are_never_dropped_even_past_the_bound():
    held = [Emit(k) for k in range(50)] + _heartbeats(10)
    kept, dropped = trim_held(held, 20)
    assert [a for a in kept if isinstance(a, Emit)] == [Emit(k) for k in range(50)]
    assert dropped == 20 and not any(isinstance(a, Send) for a in kept)
