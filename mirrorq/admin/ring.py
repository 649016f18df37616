"""Every queue's GM ring as rows: what ``mirrorctl ring`` and the management API's ring page show.

One row per queue: its replicas in ring order (the ``gm_pids`` of the
``amqqueue`` record, the order GM forwards in), each with its node and
state -- the master, a synchronised mirror, an unsynchronised one, one
``syncing N`` (records sent so far) or one whose node is down -- and the
queue's messages, the master's mirror lag (broadcasts not yet held by every
mirror: what ``ha-confirm-mode: async`` lets lag) and records sent by sync.

A quorum queue's row shows its Raft group instead (members in the
record's order): the leader, each follower with its lag -- entries of the
leader's log it is not known to hold (the leader's last index minus its
match index for that member) --, a learner (a member being added, not yet
voting) and members whose node is down; the mirror-lag column then shows
the largest follower lag and the sync column the leader's commit index
(``commit N``).  The lags are the leader's view: a follower the leader has
not heard from since it was elected shows the lag of its match index 0.

The rows are computed by :func:`ring_rows` (pure: tests call it) from the
same reads ``list_queues`` makes (:func:`snapshot`): the records and each
live master's (or leader's) ``info``.  The text view is
:mod:`ctl.ring_view`'s.
"""

from __future__ import annotations

from typing import Any

from mirrorq.admin.session import live_infos, node_of_member


def _member_state(
    member: str, master: str | None, sync: dict, node: str | None, nodes_up: set[str], synced: set[str]
) -> str:
    if node is None or node not in nodes_up:
        return "down"
    if member == master:
        return "master"
    st = sync.get(member)
    if isinstance(st, str) and st:
        return st
    return "synchronised" if member in synced else "unsynchronised"


def ring_rows(records: list[dict], infos: dict, nodes_up: set[str]) -> list[dict]:
    """One dict per queue: ``name``, ``vhost``, ``ring`` (list of
    ``{"node", "member", "state"}`` in ring order), ``messages``,
    ``mirror_lag``, ``sync_records_sent`` (None when the master did not
    answer)."""
    out = []
    for r in sorted(records, key=lambda r: (r["vhost"], r["name"])):
        info = infos.get((r["vhost"], r["name"])) or {}
        live = info.get("value") if info.get("ok") else None
        if r.get("type") == "quorum":
            out.append(_quorum_row(r, live, nodes_up))
            continue
        master = r.get("pid")
        ring = list(r.get("gm_pids") or ([master] if master else []) + list(r.get("slave_pids") or ()))
        for m in [master, *(r.get("slave_pids") or ())]:
            if m and m not in ring:
                ring.append(m)  # listed but not (yet) in the view: shown after the ring
        synced = set(r.get("sync_slave_pids") or ())
        sync = (live or {}).get("sync") or {}
        members = []
        for m in ring:
            node = node_of_member(m)
            members.append({"node": node, "member": m, "state": _member_state(m, master, sync, node, nodes_up, synced)})
        out.append(
            {
                "vhost": r["vhost"],
                "name": r["name"],
                "ring": members,
                "messages": None if live is None else live.get("messages"),
                "mirror_lag": None if live is None else live.get("mirror_lag"),
                "sync_records_sent": None if live is None else live.get("sync_records_sent"),
            }
        )
    return out


def _quorum_row(r: dict, live: dict | None, nodes_up: set[str]) -> dict:
    """A quorum queue's line (see the module docstring)."""
    leader = str(r.get("pid") or "").rpartition("#")[0] or None
    learners = set((live or {}).get("learners") or ())
    match = (live or {}).get("match") or {}
    last = (live or {}).get("last_index")
    members, lags = [], []
    for m in r.get("members") or ():
        node = node_of_member(m)
        lag = None
        if node is None or node not in nodes_up:
            state = "down"
        elif m == leader:
            state = "leader"
        else:
            state = "learner" if m in learners else "follower"
            if isinstance(last, int) and m in match:
                lag = max(0, last - int(match[m]))
                lags.append(lag)
        members.append({"node": node, "member": m, "state": state, "lag": lag})
    return {
        "vhost": r["vhost"],
        "name": r["name"],
        "type": "quorum",
        "ring": members,
        "messages": None if live is None else live.get("messages"),
        "mirror_lag": max(lags) if lags else None,
        "sync_records_sent": None,
        "commit_index": None if live is None else live.get("commit_index"),
    }


def snapshot(session: Any, vhost: str | None, timeout: float) -> list[dict]:
    records = [r for r in session.rows("amqqueue") if vhost is None or r["vhost"] == vhost]
    up = session.nodes_up()
    return ring_rows(records, live_infos(session, records, up, timeout), up)
