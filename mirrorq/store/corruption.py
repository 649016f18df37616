"""What a replica does when its store is corrupt at start.

A :class:`~mirrorq.store.segment_log.CorruptRecord` raised while a
replica opens its store (a flipped byte mid-segment: a CRC that does not
match, a length that runs past the file) names the file and the byte offset.
It is never silent:

* the store directory is **quarantined**: renamed to
  ``<dir>.corrupt-<unix time>`` (kept for inspection, never deleted by us);
* ``node.log`` gets one ``store_corrupt`` event at level ``error`` with the
  queue, the file, the offset, the reason, where the store went and the
  operator action;
* the registry gets a ``queue_alert`` row (key: vhost, queue, node) with the
  same facts; ``mirrorctl list_queues``' ``state`` shows it after the
  queue's state, so the report survives node.log rotation and is seen from
  every node.

Then, for a replica that **joins** as a mirror, the store is expendable: the
mirror starts empty and resyncs from the master like a new mirror (the
action says so).  A replica **recovering** a queue as its master (the first
member of its last view after a full restart) holds the only copy the
cluster may have: it does not start on an empty store (that would lose the
queue silently); the alert's action tells the operator to repair or move
the quarantined store back, after which the node recovers it at its next
start.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from mirrorq.store.segment_log import CorruptRecord

ACTION_RESYNC = (
    "the corrupt store was quarantined to {quarantine}; this mirror starts empty and resyncs from the master"
)
ACTION_MASTER = (
    "the corrupt store was quarantined to {quarantine}; this replica was recovering the queue as its "
    "master and does not start (an empty store would lose the queue): repair the file or move the "
    "store back to {directory} and restart the node, or delete the queue"
)


def quarantine(directory: str, now: float | None = None) -> str:
    """Rename ``directory`` aside; return the new path."""
    stamp = int(now if now is not None else time.time())
    dest = f"{directory}.corrupt-{stamp}"
    n = 0
    while os.path.exists(dest):
        n += 1
        dest = f"{directory}.corrupt-{stamp}-{n}"
    os.rename(directory, dest)
    return dest


def alert_record(
    vhost: str, name: str, node: str, err: CorruptRecord, quarantined: str, action: str, now: float
) -> dict[str, Any]:
    return {
        "vhost": vhost,
        "name": name,
        "node": node,
        "event": "store_corrupt",
        "file": err.path,
        "offset": err.offset,
        "reason": err.reason,
        "quarantined_to": quarantined,
        "action": action,
        "time": float(now),
    }


def handle(
    err: CorruptRecord,
    *,
    directory: str,
    vhost: str,
    name: str,
    node: str,
    joining: bool,
    log: Callable[..., Any],
    send_txn: Callable[[dict], Any],
) -> bool:
    """Quarantine, log, record the alert; True when the replica may go on
    with an empty store (a joining mirror), False when it must not start."""
    now = time.time()
    q = quarantine(directory, now)
    action = (ACTION_RESYNC if joining else ACTION_MASTER).format(quarantine=q, directory=directory)
    log(
        "store_corrupt",
        level="error",
        queue=name,
        vhost=vhost,
        file=err.path,
        offset=err.offset,
        reason=err.reason,
        quarantined_to=q,
        action=action,
    )
    rec = alert_record(vhost, name, node, err, q, action, now)
    send_txn({"ops": [{"op": "put", "table": "queue_alert", "key": [vhost, name, node], "record": rec}]})
    return joining


def describe(alert: dict) -> str:
    """One line for list_queues' state."""
    return (
        f"{alert.get('node')}: store corrupt in {alert.get('file')} at offset {alert.get('offset')} "
        f"({alert.get('reason')}): {alert.get('action')}"
    )
