"""Test support for GM simulations: a registry oracle and a node wrapper.

The real registry is Raft-replicated (mirrorq.mnesia_like, built elsewhere).
For GM tests it is modelled by one simulated node, ``"registry"``: it holds the
group's view, applies a ``ProposeView`` only if its ``expected_version`` is the
current version, and pushes every committed view to every GM node it knows,
re-pushing until each one acknowledges it.  A member partitioned away from the
registry can propose nothing, which is what a Raft minority amounts to.

``GMNode`` wraps a :class:`mirrorq.gm.core.GMMember` for the simulator: it
turns ``Emit(ProposeView)`` into a message to the registry (keeping the Emit
for the checker) and registry pushes into ``install_view``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mirrorq.gm.core import GMMember, ProposeView
from mirrorq.gm.view import View
from mirrorq.sansio import Emit, Send, SetTimer

REGISTRY = "registry"
REPUSH = ("registry", "repush")
RESUBSCRIBE = ("node", "subscribe")


@dataclass(frozen=True)
class Subscribe:
    pass


@dataclass(frozen=True)
class Propose:
    expected_version: int
    members: tuple[str, ...]


@dataclass(frozen=True)
class Push:
    view: View


@dataclass(frozen=True)
class PushAck:
    version: int


class RegistryOracle:
    def __init__(self, members: tuple[str, ...], *, repush: float = 0.05):
        self.view = View(1, tuple(members))
        self.subscribers: set[str] = set(members)
        self.acked: dict[str, int] = {}
        self.repush = repush
        self.history: list[View] = [self.view]
        self._armed = False

    def start(self, now: float) -> list:
        return self._push_all()

    def receive(self, now: float, src: str, msg: Any) -> list:
        if isinstance(msg, Subscribe):
            self.subscribers.add(src)
            return self._push_all()
        if isinstance(msg, PushAck):
            self.acked[src] = max(self.acked.get(src, 0), msg.version)
            return []
        if isinstance(msg, Propose):
            if msg.expected_version != self.view.version or msg.members == self.view.members:
                return []
            if not msg.members:
                return []
            self.view = View(self.view.version + 1, msg.members)
            self.history.append(self.view)
            return self._push_all()
        raise TypeError(f"registry got {msg!r}")

    def timer(self, now: float, key: Any) -> list:
        self._armed = False
        return self._push_all()

    def _push_all(self) -> list:
        actions: list = []
        for name in sorted(self.subscribers):
            if self.acked.get(name, 0) < self.view.version:
                actions.append(Send(name, Push(self.view)))
        if actions and not self._armed:
            self._armed = True
            actions.append(SetTimer(REPUSH, self.repush))
        return actions


class GMNode:
    """A GM member as a simulator node, wired to the registry oracle."""

    def __init__(self, name: str, *, subscribe: bool = False, **kw: Any):
        self.member = GMMember(name, **kw)
        self.subscribe = subscribe
        self.heard_registry = False

    def _out(self, actions: list) -> list:
        res = []
        for a in actions:
            res.append(a)
            if isinstance(a, Emit) and isinstance(a.event, ProposeView):
                res.append(Send(REGISTRY, Propose(a.event.expected_version, a.event.members)))
        return res

    def start(self, now: float) -> list:
        actions = self.member.start(now)
        if self.subscribe:
            actions += [Send(REGISTRY, Subscribe()), SetTimer(RESUBSCRIBE, 0.05)]
        return self._out(actions)

    def receive(self, now: float, src: str, msg: Any) -> list:
        if src == REGISTRY:
            if not isinstance(msg, Push):
                raise TypeError(f"unexpected registry message {msg!r}")
            self.heard_registry = True
            actions = self.member.install_view(now, msg.view)
            actions.append(Send(REGISTRY, PushAck(msg.view.version)))
            return self._out(actions)
        return self._out(self.member.receive(now, src, msg))

    def timer(self, now: float, key: Any) -> list:
        if key == RESUBSCRIBE:
            if self.heard_registry:
                return []
            return [Send(REGISTRY, Subscribe()), SetTimer(RESUBSCRIBE, 0.05)]
        return self._out(self.member.timer(now, key))

    def broadcast(self, now: float, payload: Any) -> list:
        return self._out(self.member.broadcast(now, payload))

    def end_turn(self, now: float) -> list:
        return self._out(self.member.end_turn(now))

    def member_down(self, now: float, name: str) -> list:
        return self._out(self.member.member_down(now, name))

    def member_up(self, now: float, name: str) -> list:
        return self._out(self.member.member_up(now, name))

    def join(self, now: float) -> list:
        return self._out(self.member.join(now))
