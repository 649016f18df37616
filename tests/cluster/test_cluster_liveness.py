"""Real multi-process clusters: start, kill detection, rejoin, idle accuracy,
clean stop.  Times come from the nodes' own structured logs (the moment the
survivor decided), polled with deadlines."""

from __future__ import annotations

import time

import pytest
from conftest import processes_under

from mirrorq.admin.cluster import poll as _poll
from mirrorq.node import log as nodelog

pytestmark = pytest.mark.cluster


def _view(c, observer):
    """``observer``'s view of every node's state; empty when its status did not
    answer in time (a busy machine), which no predicate below accepts."""
    st = c.cluster.status(observer)
    return {} if st is None else {n: v["state"] for n, v in st.view.items()}


def _down_records(c, observer, peer, since):
    return [
        r
        for r in nodelog.read(str(c.data_dir / observer))
        if r["event"] == "node_down" and r["peer"] == peer and r["ts"] >= since
    ]


def test_kill_any_node_is_detected_and_it_rejoins(cluster3):
    c = cluster3
    names = c.cluster.node_names()
    assert names == ["node1", "node2", "node3"]
    bound = c.timeout + 2 * c.interval + 0.3  # silence of `timeout`, tick granularity, scheduling
    for victim in names:  # node1, the first started, included
        others = [n for n in names if n != victim]
        killed_at = time.time()
        assert c.ctl("kill_node", victim) == 0
        assert not c.cluster.is_running(victim)
        assert _poll(lambda: all(_view(c, o).get(victim) == "down" for o in others), timeout=bound + 5)
        for o in others:
            recs = _down_records(c, o, victim, killed_at)
            # nothing listens at a killed node's address: refused twice, down
            # without waiting for the timeout (membership's "unreachable")
            assert len(recs) == 1 and recs[0]["reason"] == "unreachable", recs
            assert recs[0]["ts"] - killed_at <= bound, f"{o} took {recs[0]['ts'] - killed_at:.2f}s to see {victim} down"
        assert c.ctl("start_node", victim) == 0
        assert _poll(lambda: all(set(_view(c, o).values()) == {"up"} and len(_view(c, o)) == 3 for o in names), 30)


def test_graceful_stop_is_reported_at_once_as_left(cluster3):
    c = cluster3
    t0 = time.time()
    assert c.ctl("stop_node", "node2") == 0
    assert _poll(lambda: _view(c, "node1").get("node2") == "down" and _view(c, "node3").get("node2") == "down", 30)
    for o in ("node1", "node3"):
        assert [r["reason"] for r in _down_records(c, o, "node2", t0)] == ["left"]
    assert c.ctl("start_node", "node2") == 0
    assert _poll(lambda: _view(c, "node2") == {"node1": "up", "node2": "up", "node3": "up"}, 30)


def test_idle_cluster_reports_no_false_down(cluster3):
    c = cluster3
    t0 = time.time()
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:  # watch the whole minute, not just its end
        for o in ("node1", "node2", "node3"):
            v = _view(c, o)  # an unanswered status says nothing; the logs below are checked in full
            assert not v or set(v.values()) == {"up"}, f"{o} sees {v}"
        time.sleep(1.0)  # the sampling period of a one-minute watch
    for o in ("node1", "node2", "node3"):
        downs = [r for r in nodelog.read(str(c.data_dir / o)) if r["event"] == "node_down" and r["ts"] >= t0]
        assert downs == []


def test_cluster_stop_leaves_no_process(data_root):
    from conftest import LocalCluster

    c = LocalCluster(data_root, 3, interval=0.2, timeout=1.5)
    try:
        c.start()
        assert len(processes_under(data_root)) >= 3 * 2  # admin + agent per node at least
        assert c.ctl("cluster", "stop") == 0
        assert _poll(lambda: processes_under(data_root) == [], 30)
        assert all(c.cluster.pid_info(n) is None for n in c.cluster.node_names())
        # and it starts again from its data dir, remembering its layout
        assert c.ctl("cluster", "start") == 0
        assert all(c.cluster.is_running(n) for n in c.cluster.node_names())
    finally:
        c.stop()
    assert _poll(lambda: processes_under(data_root) == [], 30)
