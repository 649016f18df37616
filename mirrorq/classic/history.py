"""history: the master's operation history in the node log, one line per batch.

The audit (:mod:`mirrorq.spark.audit`, ``mirrorctl audit``) reads every
node's ``node.log`` and checks it with the clients' histories.  The queue's
master writes, through :meth:`QueueReplica.log_event` (so only where the
shell gave the replica a log; the simulator's replicas log nothing):

* ``event: "history"`` once per handler that changed the queue (one client
  batch -> one GM broadcast -> one line), with the operations it appended:
  ``publish``: ``[[offset, publisher, seq, ref, ref_seq], ...]`` --
  ``publisher`` is the channel id as text ``"dst|uid"`` and ``seq`` its
  publish seq (the master's msg_id is ``"dst|uid|seq"``); ``ref`` /
  ``ref_seq`` are the client's ``x-publisher-ref`` / ``x-publishing-id``
  when it sent them (else null);
  ``deliver``: ``[[offsets...], ack_required]`` per DELIVER record;
  ``ack``, ``requeue``: offsets; ``purge``: count of records.
* ``event: "history_confirm"`` once per GM round completion that released
  confirms: ``confirm``: ``[[publisher, first_seq, last_seq], ...]`` runs.
* ``event: "history_nack"``: ``nack``: ``[[publisher, seq, reason]]``.
* ``event: "stream_commit"`` / view changes, promotions and sync are the
  events the replica and its shell log already (``view_change``,
  ``promoted``, ``sync_started``, ``mirror_synchronised``).

Each line costs one ``os.write`` of a JSON object per batch, never per
message.  Guarantee: what a line names was appended to the master's store
before the line was written (``history``) or confirmed to the publisher
(``history_confirm``); a master killed between append and log loses the
line, not the operation -- the audit treats the node logs as evidence,
the clients' histories as the truth of what was acknowledged.
"""

from __future__ import annotations

from typing import Any

from mirrorq.amqp.properties import PUBLISHER_REF

# The channel-id key under which a client's own publisher identity
# (``x-publisher-ref``) keeps its high-water mark in ``replica.hwm``; not a
# reply address (promotion sends NewMaster to every other key's dst).
REF_KEY = "x-publisher-ref"
# The key under which a dead-letter source queue's high-water mark is kept
# (the router's publishes carry ``_d`` = [source, dead-letter seq]).
DEAD_LETTER_KEY = "x-dead-letter-source"
#: hwm keys that are not channels (no reply address)
NOT_CHANNELS = (REF_KEY, DEAD_LETTER_KEY)


def enabled(r: Any) -> bool:
    return getattr(r, "_log", None) is not None


def log_ops(r: Any, ops: list) -> None:
    """One ``history`` line for the records one handler appended."""
    pub, dlv, ack, rq = [], [], [], []
    other = 0
    for offset, rtype, body in ops:
        if rtype == 1:
            mid = body[0]
            p, _, seq = mid.rpartition("|") if isinstance(mid, str) else ("", "", "")
            ref = (body[2] or {}).get(PUBLISHER_REF) if isinstance(body[2], dict) else None
            pub.append(
                [offset, p, int(seq) if seq.isdigit() else seq, ref[0] if ref else None, ref[1] if ref else None]
            )
        elif rtype == 2:
            dlv.append([list(body[0]), body[1]])
        elif rtype == 3:
            ack.extend(body[0])
        elif rtype == 4:
            rq.extend(body[0])
        else:
            other += 1
    rec: dict = {}
    if pub:
        rec["publish"] = pub
    if dlv:
        rec["deliver"] = dlv
    if ack:
        rec["ack"] = ack
    if rq:
        rec["requeue"] = rq
    if other:
        rec["other"] = other
    if rec:
        r.log_event("history", **rec)


def log_confirms(r: Any, confirms: dict) -> None:
    """One ``history_confirm`` line: ``{publisher: [seqs]}`` as runs."""
    runs = []
    for p, seqs in confirms.items():
        name = f"{p[0]}|{p[1]}"
        first = last = None
        for s in sorted(seqs):
            if last is not None and s == last + 1:
                last = s
                continue
            if first is not None:
                runs.append([name, first, last])
            first = last = s
        if first is not None:
            runs.append([name, first, last])
    if runs:
        r.log_event("history_confirm", confirm=runs)


def log_nacks(r: Any, publisher: Any, seqs: Any, reason: str) -> None:
    name = f"{publisher[0]}|{publisher[1]}"
    r.log_event("history_nack", nack=[[name, s, reason] for s in seqs])
