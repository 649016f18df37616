"""mirrorctl ring: the rows of the live ring view (pure), and its rendering."""

from __future__ import annotations

import io

from ctl.ring_view import render
from mirrorq.admin.ring import ring_rows


def _m(node: str, uid: int) -> str:
    return f"{node}/127.0.0.1:{19500 + uid}/{uid}"


def test_ring_order_states_and_down_nodes():
    m1, m2, m3, m4 = _m("node1", 1), _m("node2", 2), _m("node3", 3), _m("node4", 4)
    rec = {
        "vhost": "/",
        "name": "q",
        "pid": m2,
        "slave_pids": [m3, m1, m4],
        "sync_slave_pids": [m3],
        "gm_pids": [m1, m2, m3],
    }  # m4: started, not in the view yet
    info = {
        ("/", "q"): {
            "ok": True,
            "value": {
                "messages": 7,
                "mirror_lag": 2,
                "sync_records_sent": 40,
                "sync": {m1: "syncing 40", m3: "synchronised"},
            },
        }
    }
    (row,) = ring_rows([rec], info, {"node1", "node2", "node4"})
    assert [(x["node"], x["state"]) for x in row["ring"]] == [
        ("node1", "syncing 40"),
        ("node2", "master"),
        ("node3", "down"),
        ("node4", "unsynchronised"),
    ]
    assert (row["messages"], row["mirror_lag"], row["sync_records_sent"]) == (7, 2, 40)


def test_master_not_answering_shows_unknown_counts_and_render_names_everything():
    from rich.console import Console

    m1, m2 = _m("node1", 1), _m("node2", 2)
    recs = [
        {"vhost": "v", "name": "b", "pid": m1, "slave_pids": [m2], "sync_slave_pids": [m2], "gm_pids": [m1, m2]},
        {"vhost": "/", "name": "a", "pid": m1, "slave_pids": [], "gm_pids": []},
    ]
    rows = ring_rows(recs, {("v", "b"): {"ok": False, "error": "timeout"}}, {"node1", "node2"})
    assert [r["name"] for r in rows] == ["a", "b"]  # sorted by vhost, name
    assert rows[1]["messages"] is None and rows[1]["ring"][1]["state"] == "synchronised"
    assert [x["node"] for x in rows[0]["ring"]] == ["node1"]  # no view yet: the master alone
    out = io.StringIO()
    Console(file=out, width=160).print(render(rows, "t"))
    text = out.getvalue()
    assert "v/b" in text and "node1 (master) → node2 (synchronised) ↺" in text and "?" in text
