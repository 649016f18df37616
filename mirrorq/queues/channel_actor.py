"""The channel actor: a client's channel living on a node (internal client API).

The internal client (:mod:`.client`) drives queues from tests and benchmarks
before the AMQP front end lands; it is not a second public protocol.  Its
channels run here, on the node it connected to, as one actor holding one
:class:`~mirrorq.queues.channel.QueueChannel` per queue: the same
core an AMQP channel will use.  The actor

* finds a queue's master in ``amqqueue`` (``pid``, a GM member name that
  carries the replica's address) and re-reads the record every
  ``MASTER_POLL`` seconds: when it changes (a promotion) the core resends
  what is unconfirmed and re-registers its consumers.  A master that died
  answers nothing (Thespian sends to a dead node vanish), so the record is
  what tells;
* buffers deliveries until the client fetches them, acking what it hands
  over (auto-ack after hand-over, like a consumer that acks on receipt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from thespian.actors import ActorExitRequest, WakeupMessage

from mirrorq.node.addresses import address_text
from mirrorq.node.messages import RegistryGet, RegistryRows
from mirrorq.node.posting import PostingActor
from mirrorq.queues import channel as chmod
from mirrorq.queues import messages as qm
from mirrorq.queues.manager import DeclareQueue, DeclareResult

MASTER_POLL = 0.2
PUBLISH_CHUNK = 200


@dataclass
class ChannelInit:
    agent: Any
    manager: Any


@dataclass
class Cmd:
    """A command from the internal client: ``op`` and its arguments; ``rid``
    is echoed in its :class:`Reply` (the client drops a late answer to an
    ask that timed out instead of taking it for the next one's)."""

    op: str
    queue: str = ""
    args: dict = field(default_factory=dict)
    rid: int = 0


@dataclass
class Reply:
    ok: bool
    value: Any = None
    error: str = ""
    rid: int = 0


class ChannelActor(PostingActor):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.agent = None
        self.queues: dict[str, dict] = {}
        self.pending_declare: list = []
        self.pending_info: dict[tuple, Any] = {}
        self.polling = False
        self.reads: list = []  # queue names whose amqqueue read is outstanding, in order
        self.uid_base = qm.channel_key() << 32  # channel ids are never reused (messages' docstring)

    def end_turn(self) -> None:
        for q in self.queues.values():
            for a in q["core"].flush(self.now):  # the turn's settlements: one Settle per master
                self._do(q, a)

    def on_message(self, msg, sender):
        if isinstance(msg, ChannelInit):
            self.agent, self.manager = msg.agent, msg.manager
            self.dst = address_text(self.myAddress)  # "host:port"
            self.send(sender, Reply(True, self.dst))
            return
        if isinstance(msg, Cmd):
            try:
                return self._cmd(msg, sender)
            except (ValueError, TypeError, KeyError) as e:
                self.send(sender, Reply(False, error=f"{msg.op}: {e}", rid=msg.rid))
                return
        if isinstance(msg, DeclareResult):
            if self.pending_declare:
                who, rid = self.pending_declare.pop(0)
                self.send(who, Reply(msg.ok, msg.record, msg.error, rid))
            return
        if isinstance(msg, RegistryRows):
            return self._rows(msg)
        if isinstance(msg, WakeupMessage):
            self.polling = False
            self._poll()
            return
        if isinstance(msg, ActorExitRequest):
            for q in self.queues.values():
                for a in q["core"].close(self.now):
                    self._do(q, a)
            return
        for q in self.queues.values():
            if getattr(msg, "queue", None) == q["name"]:
                for a in q["core"].receive(self.now, sender, msg):
                    self._do(q, a)
                return

    # ---- commands ---------------------------------------------------------------------
    def _cmd(self, c: Cmd, sender) -> None:
        now = self.now
        if c.op == "declare":
            self.pending_declare.append((sender, c.rid))
            self.post(self.manager, DeclareQueue(dict(c.args["spec"]), tuple(c.args.get("nodes", ()))))
            return
        if c.op == "open":
            if c.queue not in self.queues:
                n = len(self.queues) + 1
                self.queues[c.queue] = {
                    "name": c.queue,
                    "vhost": c.args.get("vhost", "/"),
                    "core": chmod.QueueChannel((self.dst, self.uid_base + n), c.queue, None),
                    "confirmed": 0,
                    "nacked": 0,
                    "deliveries": [],
                    "cancelled": [],
                    "opened_by": sender,
                    "redirects": 0,
                }
            self._read(c.queue)
            self._poll()
            opened = self.queues[c.queue]
            if opened["core"].master is not None:
                self.send(sender, Reply(True, opened["core"].master, rid=c.rid))
            else:
                opened["open_waiters"] = opened.get("open_waiters", []) + [(sender, c.rid)]
            return
        q = self.queues.get(c.queue)
        if q is None:
            self.send(sender, Reply(False, error=f"queue {c.queue!r} is not open on this channel", rid=c.rid))
            return
        core = q["core"]
        if c.op == "publish":
            bodies = c.args["bodies"]
            persistent = bool(c.args.get("persistent", True))
            props = dict(c.args.get("properties") or {})
            for i in range(0, len(bodies), PUBLISH_CHUNK):
                for a in core.publish(now, [(b, props, persistent) for b in bodies[i : i + PUBLISH_CHUNK]]):
                    self._do(q, a)
            self.send(sender, Reply(True, core.next_seq - 1, rid=c.rid))
        elif c.op == "confirms":
            self.send(
                sender,
                Reply(
                    True,
                    {
                        "published": core.next_seq - 1,
                        "confirmed": q["confirmed"],
                        "nacked": q["nacked"],
                        "unconfirmed": len(core.unconfirmed),
                        "master": core.master,
                        "redirects": q["redirects"],
                    },
                    rid=c.rid,
                ),
            )
        elif c.op == "consume":
            for a in core.consume(
                now,
                c.args.get("tag", "ctag"),
                prefetch=int(c.args.get("prefetch", 0)),
                arguments=c.args.get("arguments"),
            ):
                self._do(q, a)
            self.send(sender, Reply(True, rid=c.rid))
        elif c.op == "fetch":
            got = q["deliveries"][: int(c.args.get("max", 1000))]
            del q["deliveries"][: len(got)]
            by_epoch: dict = {}
            credit: dict = {}  # epoch -> consumer tag -> bytes taken by the caller: link credit back
            for d in got:
                by_epoch.setdefault(d.epoch, []).append(d.offset)
                tags = credit.setdefault(d.epoch, {})
                tags[d.consumer_tag] = tags.get(d.consumer_tag, 0) + len(d.body)
            for epoch, offsets in by_epoch.items():
                for a in core.settle(now, epoch, ack=offsets, credit=list(credit[epoch].items())):
                    self._do(q, a)
            self.send(sender, Reply(True, [(d.msg_id, d.body, d.redelivered, d.epoch) for d in got], rid=c.rid))
        elif c.op in ("info", "command"):
            rid, acts = core.command(now, c.args.get("command", "info"), **c.args.get("args", {}))
            self.pending_info[(c.queue, rid)] = (sender, c.rid)
            for a in acts:
                self._do(q, a)
        else:
            self.send(sender, Reply(False, error=f"unknown command {c.op!r}", rid=c.rid))

    # ---- the core's actions ---------------------------------------------------------------
    def _do(self, q: dict, a: Any) -> None:
        from mirrorq.sansio import Emit, Send

        if isinstance(a, Send):
            self.post(a.dst, a.msg)
        elif isinstance(a, Emit):
            ev = a.event
            if isinstance(ev, chmod.Confirmed):
                q["confirmed"] += len(ev.seqs)
            elif isinstance(ev, chmod.Nacked):
                q["nacked"] += len(ev.seqs)
            elif isinstance(ev, chmod.Delivery):
                q["deliveries"].append(ev)
            elif isinstance(ev, chmod.Cancelled):
                q["cancelled"].append(ev.consumer_tag)
            elif isinstance(ev, chmod.CommandDone):
                who = self.pending_info.pop((q["name"], ev.request_id), None)
                if who is not None:
                    self.send(who[0], Reply(ev.ok, ev.value, ev.error, who[1]))
            elif isinstance(ev, chmod.Refused):
                q["refused"] = True
                self._read(q["name"])

    # ---- finding masters --------------------------------------------------------------------
    def _poll(self) -> None:
        if self.polling or not self.queues:
            return
        self.polling = True
        for name in self.queues:
            self._read(name)
        self.wakeupAfter(MASTER_POLL)

    def _read(self, name: str) -> None:
        q = self.queues[name]
        self.reads.append(name)
        self.post(self.agent, RegistryGet("amqqueue", [q["vhost"], name]))

    def _rows(self, msg: RegistryRows) -> None:
        if not self.reads:
            return
        name = self.reads.pop(0)
        q = self.queues.get(name)
        if q is None or not msg.ok or not msg.rows:
            return
        pid = msg.rows[0].get("pid")
        refused = q.pop("refused", False)
        if pid and pid == q["core"].master and refused:
            # refused by the master the registry names: send what waits again
            for a in q["core"].resend_commands(self.now):
                self._do(q, a)
            return
        if not pid or pid == q["core"].master:
            return
        if q["core"].master is not None:
            q["redirects"] += 1
        for a in q["core"].new_master(self.now, pid, pid):  # posted to the replica's name
            self._do(q, a)
        for w, rid in q.pop("open_waiters", []):
            self.send(w, Reply(True, pid, rid=rid))
