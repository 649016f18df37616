"""A GM member as a stand-alone actor, for the real-cluster tests and the
benchmark (a queue replica embeds :class:`mirrorq.gm.shell.GMShell` itself).

Created on a node (``createActor("mirrorq.gm.actor.GMMemberActor")`` through
a client of that node's admin, or through the agent with ``CreateLocal``),
then sent ``GMMemberInit(group, node)``, which makes it create its shell.
Then, driven by the messages of
:mod:`mirrorq.gm.messages`:

* ``GMInfoQuery`` -> ``GMInfo`` (its member name, view);
* ``GMCreateGroup(founders)`` / ``GMJoinGroup()`` -> ``GMAck``;
* ``GMBroadcastMany(count, size, window, chunk)`` -> ``GMAck`` at once, then
  it broadcasts ``count`` payloads of ``size`` bytes, keeping at most
  ``window`` unconfirmed and handing ``chunk`` at a time to the shell (so
  one Thespian message per hop carries many broadcasts), topping up on every
  confirm;
* ``GMReportQuery`` -> ``GMReport``.

What it records (the checks of the cluster test compare survivors' records):
per origin the number of deliveries, the last seq and a rolling digest
``d = blake2b(d || seq || blake2b(payload))``, so two members with equal
counts and digests delivered the same payloads in the same order; any seq
that is not the previous one + 1 (a gap or a duplicate) and any confirm that
does not start right after the previous one are recorded as errors.
Payloads carry the origin's seq in their first 8 bytes, checked on delivery.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from typing import Any

from thespian.actors import ActorExitRequest

from mirrorq.gm.messages import (
    GMAck,
    GMBroadcastMany,
    GMCreateGroup,
    GMInfo,
    GMInfoQuery,
    GMJoinGroup,
    GMMemberInit,
    GMReport,
    GMReportQuery,
)
from mirrorq.gm.shell import GMCallbacks, GMShell
from mirrorq.gm.view import View
from mirrorq.node.messages import AGENT_GLOBAL_NAME
from mirrorq.node.posting import PostingActor

AGENT_CLASS = "mirrorq.node.agent.NodeAgent"

MAX_ERRORS = 50


class _Recorder(GMCallbacks):
    def __init__(self, owner: GMMemberActor) -> None:
        self.owner = owner
        self.delivered: dict[str, list[Any]] = {}  # origin -> [count, last seq, digest bytes]
        self.confirmed = 0
        self.errors: list[str] = []
        self.removed = False
        self.views: list[tuple[int, list[str]]] = []

    def _error(self, text: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(text)

    def gm_delivered(self, origin: str, seq: int, payload: Any) -> None:
        rec = self.delivered.get(origin)
        if rec is None:
            rec = self.delivered[origin] = [0, seq - 1, b""]
        if seq != rec[1] + 1:
            self._error(f"{origin}: delivered seq {seq} after {rec[1]}")
        if not isinstance(payload, bytes) or int.from_bytes(payload[:8], "big") != seq:
            self._error(f"{origin}: payload of seq {seq} does not carry its seq")
        rec[0] += 1
        rec[1] = seq
        ph = hashlib.blake2b(payload if isinstance(payload, bytes) else repr(payload).encode(), digest_size=16).digest()
        rec[2] = hashlib.blake2b(rec[2] + seq.to_bytes(8, "big") + ph, digest_size=16).digest()

    def gm_confirmed(self, first: int, last: int) -> None:
        if first != self.confirmed + 1 or last < first:
            self._error(f"confirm {first}..{last} after {self.confirmed}")
        self.confirmed = max(self.confirmed, last)
        self.owner._confirmed(first, last)

    def gm_members_changed(self, view: View, births: tuple[str, ...], deaths: tuple[str, ...]) -> None:
        self.views.append((view.version, list(view.members)))

    def gm_removed(self) -> None:
        self.removed = True


class GMMemberActor(PostingActor):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.shell: GMShell | None = None

    def end_turn(self) -> None:
        if self.shell is not None:
            self.shell.end_turn()

    def on_message(self, msg, sender):
        if isinstance(msg, GMMemberInit):
            if self.shell is None:
                self._init(msg, sender)
            return
        shell = self.shell
        if shell is None or isinstance(msg, ActorExitRequest):
            return
        if shell.handle(msg, sender):
            return
        if isinstance(msg, GMInfoQuery):
            v = shell.view
            self.send(sender, GMInfo(shell.name, None if v is None else (v.version, list(v.members)), shell.removed))
        elif isinstance(msg, GMCreateGroup):
            self._reply(sender, lambda: shell.create(tuple(msg.founders)))
        elif isinstance(msg, GMJoinGroup):
            self._reply(sender, shell.join)
        elif isinstance(msg, GMBroadcastMany):
            self._reply(sender, lambda: self._start_broadcast(msg))
        elif isinstance(msg, GMReportQuery):
            self.send(sender, self._report())

    def _started_shell(self) -> GMShell:
        """The shell ``GMMemberInit`` created: every caller runs after it."""
        if self.shell is None:
            raise RuntimeError("this GM member actor has no shell yet: it was not sent GMMemberInit")
        return self.shell

    def _reply(self, sender, fn) -> None:
        try:
            fn()
        except (ValueError, TypeError, RuntimeError) as e:
            self.send(sender, GMAck(False, str(e)))
            return
        self.send(sender, GMAck(True))

    def _init(self, msg: GMMemberInit, sender) -> None:
        # the global-name lookup returns the node's running agent
        agent = sender if msg.via_agent else self.createActor(AGENT_CLASS, globalName=AGENT_GLOBAL_NAME)
        self.rec = _Recorder(self)
        self.shell = GMShell(self, msg.group, self.rec, agent=agent, node=msg.node, **dict(msg.options))
        self.target = 0
        self.published = 0
        self.window = 0
        self.chunk = 100
        self.size = 1024
        self.filler = b""
        self.sample_every = 10
        self.sent_at: deque[tuple[int, float]] = deque()  # sampled (seq, time), seq order
        self.latencies: list[float] = []
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.shell.start()
        prof = os.environ.get("MIRRORQ_GM_PROFILE")
        if prof:  # profile this process's whole event loop (bench/gm.py --profile)
            import cProfile

            self._profile = cProfile.Profile()
            self._profile.enable()
            self._profile_path = f"{prof}.{os.getpid()}"

    # ---- broadcasting with a window ------------------------------------------------
    def _start_broadcast(self, cmd: GMBroadcastMany) -> None:
        for f in ("count", "size", "window", "chunk", "sample_every"):
            v = getattr(cmd, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < (8 if f == "size" else 1):
                raise ValueError(f"GMBroadcastMany.{f} must be an int >= {8 if f == 'size' else 1}, got {v!r}")
        shell = self._started_shell()
        if shell.removed:
            raise RuntimeError(f"GM member {shell.name} was removed from its group")
        self.target += cmd.count
        self.finished_at = None
        self.sample_every = cmd.sample_every
        self.latencies = []  # the report gives this command's latencies
        self.window, self.chunk, self.size = cmd.window, cmd.chunk, cmd.size
        self.filler = os.urandom(cmd.size - 8)
        if self.started_at is None:
            self.started_at = time.monotonic()
        self._pump()

    def _pump(self) -> None:
        shell = self._started_shell()
        if shell.removed:
            return
        while self.published < self.target and self.published - self.rec.confirmed < self.window:
            n = min(self.chunk, self.target - self.published, self.window - (self.published - self.rec.confirmed))
            first = self.published + 1
            self.published += n
            now = time.monotonic()
            k = self.sample_every
            for s in range(first + (-first % k), self.published + 1, k):
                self.sent_at.append((s, now))
            shell.broadcast_many(s.to_bytes(8, "big") + self.filler for s in range(first, self.published + 1))

    def _confirmed(self, first: int, last: int) -> None:
        now = time.monotonic()
        sent = self.sent_at
        while sent and sent[0][0] <= last:
            self.latencies.append((now - sent.popleft()[1]) * 1000)
        if self.finished_at is None and self.target and self.rec.confirmed >= self.target:
            self.finished_at = now
        self._pump()

    def _report(self) -> GMReport:
        if getattr(self, "_profile", None) is not None:
            self._profile.dump_stats(self._profile_path)
        shell = self._started_shell()
        v = shell.view
        return GMReport(
            name=shell.name,
            view=None if v is None else (v.version, list(v.members)),
            removed=shell.removed,
            delivered={o: (r[0], r[1], r[2].hex()) for o, r in self.rec.delivered.items()},
            published=self.published,
            confirmed=self.rec.confirmed,
            errors=list(self.rec.errors),
            stats={**shell.info()["stats"], **shell.counters, "cpu_s": time.process_time()},
            started=self.started_at,
            finished=self.finished_at,
            latencies_ms=list(self.latencies),
        )


# ---- for tools: spawn and drive members from outside -----------------------------
def spawn_member(asys, group: str, node: str, **options) -> object:
    """Create a GMMemberActor in the node whose admin ``asys`` (an external
    ActorSystem connection, e.g. ``NodeClient(...).asys``) talks to, and
    initialise it.  Returns its address."""
    addr = asys.createActor("mirrorq.gm.actor.GMMemberActor")
    asys.tell(addr, GMMemberInit(group, node, dict(options)))
    return addr


def ask_info(asys, addr, timeout: float = 5.0) -> GMInfo:
    r = asys.ask(addr, GMInfoQuery(), timeout)
    if not isinstance(r, GMInfo):
        raise TimeoutError(f"GM member {addr} did not answer an info query within {timeout}s (got {r!r})")
    return r


def ask_report(asys, addr, timeout: float = 10.0) -> GMReport:
    r = asys.ask(addr, GMReportQuery(), timeout)
    if not isinstance(r, GMReport):
        raise TimeoutError(f"GM member {addr} did not answer a report query within {timeout}s (got {r!r})")
    return r


def ask_ok(asys, addr, msg, timeout: float = 5.0) -> None:
    r = asys.ask(addr, msg, timeout)
    if not isinstance(r, GMAck) or not r.ok:
        raise RuntimeError(f"GM member {addr} refused {msg!r}: {r!r}")
