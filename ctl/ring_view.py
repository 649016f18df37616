"""``mirrorctl ring``: a live view of every queue's GM ring (rows: :mod:`mirrorq.admin.ring`).

``--watch`` redraws every ``--interval`` seconds (rich's ``Live``) until
Ctrl-C or ``--count`` frames; a frame whose node cannot be reached says so
and the next one tries again.  ``--formatter json`` prints one JSON array
per frame (a line each), for scripts.
"""

from __future__ import annotations

import json
import time
from typing import Any

from mirrorq.admin.ring import snapshot

#: a member's state -> its colour in the ring
_STYLE = {
    "master": "bold green",
    "leader": "bold green",
    "synchronised": "green",
    "follower": "green",
    "unsynchronised": "yellow",
    "learner": "yellow",
    "down": "red",
}


def render(rows: list[dict], title: str) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title)
    for c in (
        "queue",
        "ring (GM order; ↺ back to the first) / quorum group",
        "messages",
        "mirror lag",
        "sync sent / commit",
    ):
        table.add_column(c)
    for row in rows:
        ring = Text()
        for i, m in enumerate(row["ring"]):
            if i:
                ring.append(" → ")
            label = f"{m['node'] or m['member']}"
            state = m["state"]
            ring.append(label, style=_STYLE.get(state, "cyan"))
            lag = f", lag {m['lag']}" if m.get("lag") is not None else ""
            ring.append(" (master)" if state == "master" else f" ({state}{lag})", style="dim")
        quorum = row.get("type") == "quorum"
        if row["ring"] and not quorum:
            ring.append(" ↺")
        name = row["name"] if row["vhost"] == "/" else f"{row['vhost']}/{row['name']}"
        if quorum:
            name += " (quorum)"
        last = (
            (f"commit {row['commit_index']}" if row.get("commit_index") is not None else "?")
            if quorum
            else ("?" if row["sync_records_sent"] is None else str(row["sync_records_sent"]))
        )
        cells = (
            [Text(name), ring]
            + [Text("?" if row[k] is None else str(row[k])) for k in ("messages", "mirror_lag")]
            + [Text(last)]
        )
        table.add_row(*cells)
    if not rows:
        table.add_row(Text("(no queues)"), Text(""), Text(""), Text(""), Text(""))
    return table


def run(args: Any, connect: Any) -> int:
    """``connect(args)`` opens a NodeSession (mirrorctl's)."""
    frames = 0

    def frame() -> tuple[list[dict] | None, str]:
        try:
            with connect(args) as s:
                return snapshot(s, args.vhost, 5.0 if args.timeout is None else args.timeout), ""
        except Exception as e:  # noqa: BLE001 - a frame reports any failure and the next one retries
            return None, f"{type(e).__name__}: {e}"

    def title(err: str) -> str:
        stamp = time.strftime("%H:%M:%S")
        return f"queue rings at {stamp}" + (f" -- {err}" if err else "")

    if args.formatter == "json":
        while True:
            rows, err = frame()
            if rows is None and not args.watch:
                raise RuntimeError(err)
            print(json.dumps(rows if rows is not None else {"error": err}, default=str), flush=True)
            frames += 1
            if not args.watch or (args.count and frames >= args.count):
                return 0
            time.sleep(args.interval)  # the refresh period of a live view

    from rich.console import Console
    from rich.live import Live

    console = Console()
    rows, err = frame()
    if not args.watch:
        if rows is None:
            raise RuntimeError(err)
        console.print(render(rows, title("")))
        return 0
    last: list[dict] = rows or []
    try:
        with Live(render(last, title(err)), console=console, refresh_per_second=4) as live:
            frames = 1
            while not (args.count and frames >= args.count):
                time.sleep(args.interval)  # the refresh period of a live view
                rows, err = frame()
                last = rows if rows is not None else last
                live.update(render(last, title(err)))
                frames += 1
    except KeyboardInterrupt:
        pass
    return 0
