"""TimerTable (mirrorq.node.timers): one checker per guarantee of its docstring,
driven by random schedules of set / cancel / wakeups against a plain model."""

import random

import pytest

from mirrorq.node.timers import TimerTable


def run(seed: int, steps: int = 400):
    """Drive a table the way a shell does (arm what it asks, deliver each armed
    wakeup at its time) next to a model of what should fire; return both logs."""
    rng = random.Random(seed)
    t = TimerTable()
    armed: list[float] = []  # wakeups the "shell" armed, not yet delivered
    model: dict[str, tuple[float, int]] = {}  # key -> (deadline, when it was set)
    fired: list[tuple[float, str]] = []
    expected: list[tuple[float, str]] = []
    now = 0.0
    wakeups = 0
    keys = [f"k{i}" for i in range(6)]

    def deliver_until(limit: float):
        nonlocal now, wakeups
        while armed and min(armed) <= limit:
            at = min(armed)
            armed.remove(at)
            now = max(now, at)
            wakeups += 1
            # the model: everything due by now, earliest first
            for k, (d, _n) in sorted(model.items(), key=lambda kv: kv[1]):
                if d <= now + 0.001:
                    expected.append((d, k))
                    del model[k]
            t.fired(at)
            due, again = t.due(now)
            fired.extend((now, k) for k in due)
            if again is not None:
                armed.append(again)

    for n in range(steps):
        step = rng.random()
        if step < 0.5:
            k = rng.choice(keys)
            at = now + rng.choice([0.0, 0.05, 0.5, 1.0, 2.0, rng.uniform(0, 3)])
            model[k] = (at, n)
            a = t.set(k, at)
            if a is not None:
                armed.append(a)
        elif step < 0.65:
            k = rng.choice(keys)
            model.pop(k, None)
            t.cancel(k)
        else:
            deliver_until(now + rng.uniform(0, 1.5))
    deliver_until(float("inf"))
    return fired, expected, model, t, wakeups


@pytest.mark.parametrize("seed", range(200))
def test_fires_exactly_the_live_timers_in_deadline_order(seed):
    fired, expected, model, t, _ = run(seed)
    # at most once per set, never after a cancel or a replacing set: exactly the model's firings
    assert [k for _, k in fired] == [k for _, k in expected]
    # nothing live is left without a wakeup to fire it
    assert not model and len(t) == 0


def test_a_rearmed_timer_costs_no_wakeup():
    t = TimerTable()
    assert t.set("election", 1.0) == 1.0
    # a follower re-arms on every AppendEntries: later deadlines need no new wakeup
    for i in range(1, 100):
        assert t.set("election", 1.0 + i * 0.01) is None
    t.fired(1.0)
    keys, again = t.due(1.0)
    assert keys == [] and again == pytest.approx(1.99)
    t.fired(again)
    assert t.due(again) == (["election"], None)


def test_an_earlier_deadline_arms_an_earlier_wakeup_and_a_cancelled_one_fires_nothing():
    t = TimerTable()
    assert t.set("timeout", 30.0) == 30.0
    assert t.set("poll", 0.1) == 0.1
    t.cancel("timeout")
    t.fired(0.1)
    assert t.due(0.1) == (["poll"], None)  # the cancelled timeout asks for no wakeup
    t.fired(30.0)
    assert t.due(30.0) == ([], None)


def test_superseded_entries_do_not_pile_up():
    t = TimerTable()
    for i in range(10_000):
        t.set("election", 2.0 + i * 0.001)
    assert len(t._heap) <= 64 + 4 * len(t)
