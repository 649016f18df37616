"""The queue host's timer grid (mirrorq.queues.host.fire_at): long
timers of many replicas fire together, short ones exactly, none early."""

from __future__ import annotations

import math

import pytest

from mirrorq.queues.host import TIMER_GRIDS, fire_at


@pytest.mark.parametrize("now", [0.0, 1000.03, 1732400000.4567, 1732400000.999])
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3, 0.5, 0.7, 1.99, 2.0, 5.3, 8.0])
def test_a_timer_never_fires_early_and_late_by_less_than_its_grid(now, delay):
    at = fire_at(now, delay)
    grid = next((g for d, g in TIMER_GRIDS if delay >= d), None)
    assert at >= now + delay - 1e-6
    if grid is None:
        assert at == now + delay
    else:
        assert at - (now + delay) < grid + 1e-6 and grid <= delay / 4
        assert math.isclose(at / grid, round(at / grid), abs_tol=1e-6)


def test_heartbeats_armed_at_different_moments_fire_together():
    """2 s heartbeats of many groups, armed across half a second, land on
    one grid point: one turn, one bundle per peer host."""
    base = 1732400000.0
    assert len({round(fire_at(base + i / 100, 2.0), 6) for i in range(1, 50)}) == 1
    assert len({round(fire_at(base + i / 100, 0.5), 6) for i in range(1, 50)}) == 5
