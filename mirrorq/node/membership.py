"""Cluster membership and liveness: who is in the cluster, who is up.

Thespian gives no usable failure detector (a dead convention member is noticed
after ~22 minutes), so every node runs this core and decides liveness itself.

Protocol
--------
* Every node has a name and an *incarnation* (a number that grows with every
  start of the node; the shell uses the start time in nanoseconds).
* Every ``interval`` seconds a node sends ``Heartbeat(incarnation, peers)`` to
  every peer it knows, up or down, and to its seeds.  ``peers`` is gossip: the
  names (and incarnations) it knows, so a node that knows one member learns
  all of them within a few rounds.
* A peer is **up** from the first heartbeat heard from it.  It is **down** when
  nothing was heard for ``timeout`` seconds, or at once when it announces a
  graceful ``Leave``.  A heartbeat carrying a *newer* incarnation than the one
  known means the peer restarted in between: it is reported down (its actors
  are gone) and up again, in that order.  A heartbeat with an *older*
  incarnation is a stale message from a previous life and is ignored.
* The shell may also report that the transport could not deliver to a peer
  at all (``unreachable``: Thespian's dead letter, i.e. the connection to
  the peer's agent was refused -- nothing listens there any more, which is
  what a killed process leaves behind).  A first report sends the peer a
  heartbeat at once as a probe; a second report with no heartbeat heard from
  the peer in between is evidence that it is gone: it is marked down (reason
  ``unreachable``) at the first moment ``timeout`` has passed since it was
  last heard, without waiting for this node's own ticks to confirm the
  silence (``quiet_ticks``).  Not sooner: a refused connection is also what
  a partition that answers with TCP resets looks like, and the peer, alive
  on the other side, steps down (pause_minority) only once it has not heard
  a majority for ``pause_after``; declaring it down earlier would let the
  majority promote while it still serves.
* Changes are emitted as ``Emit(NodeUp(name, incarnation))`` and
  ``Emit(NodeDown(name, incarnation, reason))``, exactly once per transition.

Guarantees (under the assumptions below)
----------------------------------------
* Completeness: a node that stops sending (killed, partitioned away) is
  reported down by every connected survivor within ``timeout + interval``
  of the survivor's own ticks (a survivor that stalls counts only the ticks
  it ran: ``timeout / interval`` of them must pass without a heartbeat).
* Accuracy: a node whose heartbeats keep arriving at least once per
  ``timeout`` is never reported down by the timeout, nor because the
  observer itself paused (heartbeats waiting in its inbox while it did not
  tick do not count as missing); an ``unreachable``
  report needs two refused deliveries with no heartbeat heard in between
  (a busy node's kernel still accepts connections, so only a node whose
  agent is gone is refused).
* Convergence: once the network is whole again and message loss stops, every
  live node reports every other live node up within about
  ``timeout + 2 * interval`` plus the gossip rounds needed to learn names.

Minority (RabbitMQ's ``pause_minority``)
----------------------------------------
* The core is told the cluster's voting nodes (``cluster``: the registry's
  Raft voters).  A node is **in a minority** while the cluster's nodes it
  heard from within ``pause_after`` seconds (itself included) are not more
  than half of the cluster.  Silence is counted as for ``timeout``: in wall
  time *and* in this node's own ticks, so an observer's own stall does not
  make it think it is alone.
* ``pause_after`` (default 0.6 x ``timeout``) is shorter than ``timeout``:
  a node cut off from the majority counts itself in a minority before the
  majority reports it down, so the node steps down before the majority
  acts on its absence (promotes a mirror, elects a leader).
* Transitions are emitted once each: ``Emit(QuorumLost(sees, cluster))``
  and ``Emit(QuorumRegained(sees, cluster))``.  A node starts in a minority
  (it has heard nobody yet) and regains the majority with the heartbeat that
  completes one.  With fewer than three voters (or none given) a node is
  never in a minority: one or two nodes cannot tell a partition from a
  death.

Assumptions and failure behaviour
---------------------------------
* Delivery is best effort: messages may be lost, delayed or reordered.  With
  loss, a node is reported down only after ``timeout / interval`` heartbeats in
  a row were lost.
* Liveness is *per observer*: in a partition each side reports the other side
  down.  That is the intent; deciding what a partition means for a queue is
  the registry's business (Raft majority), not this core's.
* Names are unique identities.  Contact details (Thespian addresses) are the
  shell's business; this core only names peers.
* Every peer ever learnt is reported with ``Emit(KnownPeers(names))`` when the
  set grows; the shell keeps it on disk and hands it back as ``seeds`` on the
  next start, so a restarted node finds the cluster even when its configured
  seeds are all down.  A node that knows no live node cannot join: at least one
  seed or remembered peer must be alive.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from mirrorq.sansio import Action, Emit, Send, SetTimer

TICK = "membership.tick"


# ---- messages -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Heartbeat:
    incarnation: int
    peers: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Leave:
    incarnation: int


# ---- events ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NodeUp:
    node: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class NodeDown:
    node: str
    incarnation: int
    reason: str  # "timeout" | "left" | "restarted" | "unreachable"


@dataclass(frozen=True, slots=True)
class KnownPeers:
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class QuorumLost:
    """This node hears fewer than a majority of ``cluster``: only ``sees``."""

    sees: tuple[str, ...]
    cluster: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class QuorumRegained:
    sees: tuple[str, ...]
    cluster: tuple[str, ...]


@dataclass
class PeerState:
    up: bool = False
    incarnation: int = 0
    last_heard: float = float("-inf")
    left: int = -1  # incarnation that said Leave; its late heartbeats are ignored
    refused: bool = False  # a delivery was refused since the last heartbeat heard
    gone: bool = False  # refused twice with nothing heard in between (down once the timeout passed)
    quiet_ticks: int = 0  # this node's ticks since the last heartbeat heard from the peer


class Membership:
    """The membership/liveness core of one node (see the module docstring)."""

    def __init__(
        self,
        name: str,
        incarnation: int,
        seeds: list[str] | tuple[str, ...] = (),
        *,
        interval: float = 0.2,
        timeout: float = 1.5,
        cluster: tuple[str, ...] | list[str] = (),
        pause_after: float | None = None,
    ):
        if interval <= 0 or timeout <= interval:
            raise ValueError(f"membership needs 0 < interval < timeout (got interval={interval}, timeout={timeout})")
        pause_after = 0.6 * timeout if pause_after is None else pause_after
        if not interval <= pause_after < timeout:
            raise ValueError(f"membership needs interval <= pause_after < timeout (got pause_after={pause_after})")
        self.pause_after = pause_after
        self.cluster: tuple[str, ...] = tuple(sorted(set(cluster)))
        #: in a minority of ``cluster`` (see the module docstring)
        self.in_minority = len(self.cluster) >= 3
        self.name = name
        self.incarnation = incarnation
        self.interval = interval
        self.timeout = timeout
        self.seeds = [s for s in seeds if s != name]
        self.peers: dict[str, PeerState] = {}
        self.leaving = False

    # ---- queries ----------------------------------------------------------
    def up_nodes(self) -> list[str]:
        return sorted([self.name] + [n for n, p in self.peers.items() if p.up])

    def is_up(self, node: str) -> bool:
        if node == self.name:
            return True
        peer = self.peers.get(node)
        return bool(peer and peer.up)

    def view(self, now: float) -> dict[str, dict[str, Any]]:
        """What this node believes of every node it knows, itself included."""
        out: dict[str, dict[str, Any]] = {
            self.name: {"state": "up", "incarnation": self.incarnation, "last_heard": 0.0}
        }
        for n in sorted(self.peers):
            p = self.peers[n]
            out[n] = {
                "state": "up" if p.up else "down",
                "incarnation": p.incarnation,
                "last_heard": None if p.last_heard == float("-inf") else round(now - p.last_heard, 3),
            }
        return out

    def sees(self, now: float) -> tuple[str, ...]:
        """The nodes heard from within ``pause_after`` (this one included)."""
        quiet = self.pause_after / self.interval
        fresh = [
            n
            for n, p in self.peers.items()
            if p.up and not (now - p.last_heard > self.pause_after and p.quiet_ticks > quiet)
        ]
        return tuple(sorted([self.name] + fresh))

    # ---- sans-IO entry points ---------------------------------------------
    def start(self, now: float) -> list[Action]:
        out = self._heartbeat_round() + [SetTimer(TICK, self.interval)]
        if self.in_minority:
            out.append(Emit(QuorumLost(self.sees(now), self.cluster)))
        return out

    def set_cluster(self, now: float, nodes: Iterable[str]) -> list[Action]:
        """The cluster's voting nodes changed (or were learnt)."""
        self.cluster = tuple(sorted(set(nodes)))
        return self._check_quorum(now)

    def introduce(self, now: float, node: str) -> list[Action]:
        """The shell found a node (a seed answered, a new address was learnt):
        greet it at once and heartbeat it from now on."""
        if node == self.name:
            return []
        actions: list[Action] = [Send(node, self._heartbeat())]
        if node not in self.peers:
            self.peers[node] = PeerState()
            actions.append(Emit(KnownPeers(tuple(sorted(self.peers)))))
        return actions

    def leave(self, now: float) -> list[Action]:
        """Graceful stop: tell every peer, so they need not wait for the timeout."""
        self.leaving = True
        return [Send(n, Leave(self.incarnation)) for n in sorted(self.peers)]

    def unreachable(self, now: float, node: str) -> list[Action]:
        """The transport could not deliver to ``node`` (see the docstring)."""
        peer = self.peers.get(node)
        if peer is None or not peer.up or self.leaving:
            return []
        if not peer.refused:
            peer.refused = True
            return [Send(node, self._heartbeat())]  # probe: refused again means gone
        peer.gone = True
        if now - peer.last_heard >= self.timeout:
            return self._down(node, "unreachable")
        return []  # down at the first tick once the timeout has passed

    def receive(self, now: float, src: str, msg: Any) -> list[Action]:
        if src == self.name:
            return []
        if isinstance(msg, Heartbeat):
            return self._on_heartbeat(now, src, msg)
        if isinstance(msg, Leave):
            peer = self.peers.get(src)
            if peer is None or msg.incarnation < peer.incarnation:
                return []
            peer.left = max(peer.left, msg.incarnation)
            if peer.up and msg.incarnation == peer.incarnation:
                return self._down(src, "left")
            return []
        raise TypeError(f"membership: unexpected message from {src!r}: {msg!r}")

    def timer(self, now: float, key: Hashable) -> list[Action]:
        if key != TICK or self.leaving:
            return []
        actions: list[Action] = []
        for n in sorted(self.peers):
            p = self.peers[n]
            p.quiet_ticks += 1
            # silence counts in this node's own ticks too: after a pause of
            # its own (a long turn, the machine busy) the heartbeats that
            # arrived meanwhile are still in its inbox, not missing
            if p.up and p.gone and now - p.last_heard >= self.timeout:
                actions += self._down(n, "unreachable")
            elif p.up and now - p.last_heard > self.timeout and p.quiet_ticks > self.timeout / self.interval:
                actions += self._down(n, "timeout")
        actions += self._check_quorum(now)
        actions += self._heartbeat_round()
        actions.append(SetTimer(TICK, self.interval))
        return actions

    # ---- internals ----------------------------------------------------------
    def _heartbeat(self) -> Heartbeat:
        gossip = tuple((n, p.incarnation) for n, p in sorted(self.peers.items()) if p.up)
        return Heartbeat(self.incarnation, gossip)

    def _heartbeat_round(self) -> list[Action]:
        hb = self._heartbeat()
        targets = sorted(set(self.peers) | set(self.seeds))
        return [Send(n, hb) for n in targets]

    def _on_heartbeat(self, now: float, src: str, hb: Heartbeat) -> list[Action]:
        actions: list[Action] = []
        if src not in self.peers:
            self.peers[src] = PeerState()
            actions.append(Emit(KnownPeers(tuple(sorted(self.peers)))))
        peer = self.peers[src]
        if hb.incarnation < peer.incarnation or hb.incarnation <= peer.left:
            return []  # a message from a previous life of that node, or after its Leave
        if peer.up and hb.incarnation > peer.incarnation:
            actions += self._down(src, "restarted")
        peer.last_heard = now
        peer.quiet_ticks = 0
        peer.refused = peer.gone = False
        if not peer.up:
            peer.up = True
            peer.incarnation = hb.incarnation
            actions.append(Emit(NodeUp(src, hb.incarnation)))
        for name, _inc in hb.peers:
            if name != self.name and name not in self.peers:
                actions += self.introduce(now, name)
        if self.in_minority:
            actions += self._check_quorum(now)
        return actions

    def _check_quorum(self, now: float) -> list[Action]:
        if self.leaving:
            return []
        if len(self.cluster) < 3:
            if self.in_minority:
                self.in_minority = False
                return [Emit(QuorumRegained(self.sees(now), self.cluster))]
            return []
        sees = self.sees(now)
        minority = 2 * len(set(sees) & set(self.cluster)) <= len(self.cluster)
        if minority == self.in_minority:
            return []
        self.in_minority = minority
        return [Emit((QuorumLost if minority else QuorumRegained)(sees, self.cluster))]

    def _down(self, node: str, reason: str) -> list[Action]:
        p = self.peers[node]
        p.up = False
        p.refused = p.gone = False
        return [Emit(NodeDown(node, p.incarnation, reason))]
