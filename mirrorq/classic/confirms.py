"""Publisher confirms, the master's side: what each broadcast round owes to whom.

A classic queue's master confirms a publish once every member of its GM
view holds the publish (``ha-confirm-mode: sync``, the default).  The
:class:`ConfirmLedger` is the one owner of that state on the master:

* **earned** -- the seqs each publisher's publishes earned in the handler
  running now (accepted and enqueued), until the handler's broadcast;
* **rounds** -- per broadcast (its GM seq), the confirms it carries, and
  when it was sent, until every member holds it (GM's ``Confirmed``) or
  ``ha-confirm-timeout`` expires;
* **waiting** -- per publisher, the seqs owed and the round each waits for
  (a resend of a seq still waiting is confirmed with that round, not
  enqueued again: :meth:`waiting`);
* **backup** -- the confirms of rounds the last mirror sends: the master
  sends them again :data:`CONFIRM_BACKUP_DELAY` later, one message per
  publisher for all the rounds of that while.

Who sends a round's confirms: with mirrors in the view, the mirror just
before the master in the ring (it knows the round is held one hop before
the master: GM's ``AllHold``), and the master again later (the backup: a
confirm lost with that mirror still comes; a channel drops a confirm it
already had).  Alone in its view the master sends them when the round
completes.  A round that times out is nacked instead
(:meth:`ConfirmLedger.overdue`).

Guarantees: a seq is confirmed only by the round that carries it, after
every member of that round's view holds it, or nacked; a seq is owed to
its publisher at most once at a time.  Sans-IO: no clock (callers hand
``now``), no sends (callers send what the methods return).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mirrorq.queues.messages import ChannelId

#: seconds after a round completes before the master sends again the confirms its last mirror sent
CONFIRM_BACKUP_DELAY = 0.2

Confirms = dict[ChannelId, list[int]]  # publisher -> seqs


@dataclass(slots=True)
class _Round:
    confirms: Confirms
    at: float  # when it was broadcast
    by_mirror: bool  # the last mirror sends its confirms (AllHold); the master backs them up


class ConfirmLedger:
    def __init__(self) -> None:
        self.earned: Confirms = {}
        self._rounds: dict[int, _Round] = {}  # gm seq -> round, oldest first
        self._waiting: dict[ChannelId, dict[int, int]] = {}  # publisher -> {seq: gm seq}
        self._backup: Confirms = {}

    # ---- a handler -----------------------------------------------------------------------
    def earn(self, publisher: ChannelId, seqs: list[int]) -> None:
        """``publisher``'s ``seqs`` were accepted by this handler."""
        self.earned.setdefault(publisher, []).extend(seqs)

    def take_earned(self) -> Confirms:
        """What this handler earned (and forget it: it is decided now)."""
        earned, self.earned = self.earned, {}
        return earned

    def waiting(self, publisher: ChannelId) -> Mapping[int, int]:
        """``publisher``'s seqs owed and waiting for a round: seq -> its round's GM seq."""
        return self._waiting.get(publisher, {})

    # ---- rounds ---------------------------------------------------------------------------
    def broadcast(self, gm_seq: int, confirms: Confirms, at: float, by_mirror: bool) -> None:
        """Broadcast ``gm_seq`` carries ``confirms``; ``by_mirror``: the last mirror sends them."""
        self._rounds[gm_seq] = _Round(confirms, at, by_mirror and bool(confirms))
        for pub, seqs in confirms.items():
            w = self._waiting.setdefault(pub, {})
            for s in seqs:
                w[s] = gm_seq

    def held(self, gm_seq: int) -> tuple[Confirms, bool]:
        """Every member holds round ``gm_seq``: the confirms the master sends
        now (none if the last mirror sent them), and whether confirms went
        to the backup (arm its timer if it is not armed)."""
        rnd = self._rounds.pop(gm_seq, None)
        if rnd is None or not rnd.confirms:
            return {}, False
        self._settle(rnd.confirms)
        if rnd.by_mirror:
            # the last mirror sent them a hop ago; ours follow later, in case its send was lost
            for pub, seqs in rnd.confirms.items():
                self._backup.setdefault(pub, []).extend(seqs)
            return {}, True
        return rnd.confirms, False

    def confirms_upto(self, gm_seq: int) -> Confirms:
        """The confirms of every round up to ``gm_seq`` (for the history line)."""
        out: Confirms = {}
        for g, rnd in self._rounds.items():
            if g > gm_seq:
                break
            for p, seqs in rnd.confirms.items():
                out.setdefault(p, []).extend(seqs)
        return out

    def count(self, gm_seq: int) -> int:
        """How many seqs round ``gm_seq`` confirms."""
        rnd = self._rounds.get(gm_seq)
        return sum(len(s) for s in rnd.confirms.values()) if rnd is not None else 0

    def sent_at(self, gm_seq: int) -> float | None:
        rnd = self._rounds.get(gm_seq)
        return rnd.at if rnd is not None else None

    def overdue(self, now: float, limit: float) -> tuple[list[tuple[int, Confirms]], float | None]:
        """Rounds broadcast ``limit`` seconds ago or more whose confirms are
        still owed: ``(gm seq, confirms)`` each, now nacked by the caller
        (the round stays, owing nothing); and in how long the next round
        with confirms is due (None: none waits)."""
        late: list[tuple[int, Confirms]] = []
        next_due: float | None = None
        for g, rnd in self._rounds.items():
            if not rnd.confirms:
                continue
            if now - rnd.at < limit - 1e-6:  # a timer due "now" may fire a hair early in float time
                if next_due is None:
                    next_due = max(limit - (now - rnd.at), 1e-3)
                continue
            late.append((g, rnd.confirms))
            self._settle(rnd.confirms)
            rnd.confirms = {}
        return late, next_due

    def take_backup(self) -> Confirms:
        """The confirms the backup timer sends now."""
        backup, self._backup = self._backup, {}
        return backup

    def forget_rounds(self) -> None:
        """The queue is gone: no round will complete."""
        self._rounds.clear()

    def _settle(self, confirms: Confirms) -> None:
        for pub, seqs in confirms.items():
            w = self._waiting.get(pub)
            if w is not None:
                for s in seqs:
                    w.pop(s, None)
                if not w:
                    del self._waiting[pub]
