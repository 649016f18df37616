"""A local multi-host lab: each node in its own network namespace, with its
own address, on one bridge; ``tc netem`` delay, jitter and loss per link.

Tests and benchmarks use it to run a cluster the way users run one (one node
per host, nodes reaching each other over a network, not loopback) on one
machine.  Needs root and iproute2 (``ip netns``, veth, bridge, ``tc``).

Layout of a lab named ``mqh<pid><letter>`` (:class:`NetLab`)::

    root namespace                      namespace <lab>-n1 ... <lab>-nN
    bridge <lab>b  10.77.S.1/24  --+--  veth <lab>v1 == eth0 10.77.S.11/24
                                   +--  veth <lab>v2 == eth0 10.77.S.12/24
                                   ...

``S`` is the first of 0..255 whose 10.77.S.0/24 no interface of the root
namespace uses.  Node ``i`` (1-based) has 10.77.S.(10+i) until
:meth:`NetLab.move` gives it 10.77.S.(100+i) (and back).  A process in the
root namespace (a test's pika client, mirrorctl) reaches every node over the
bridge from 10.77.S.1.

Delay: :meth:`NetLab.set_link` puts one netem qdisc on each end of node
``i``'s veth pair (egress from the node and egress toward it), so a packet
from node ``i`` to node ``j`` waits ``delay(i) + delay(j)`` and one between
the root namespace and node ``i`` waits ``delay(i)`` each way.  A kernel
built without netem (``CONFIG_NET_SCH_NETEM``) makes it raise
:class:`NetemUnavailable` saying so.

Faults: :meth:`NetLab.cut` drops (silently, one way, or with resets) what
node ``i`` exchanges with its peers, by iptables rules inside its own
namespace; :meth:`NetLab.heal` flushes them.  The root namespace keeps
reaching the node, so tools and clients see both sides of the cut.

Processes: :meth:`NetLab.spawn` starts a command inside a node's namespace
(``ip netns exec``, which execs in place: the PID it returns is the
command's) in a new session, and records its PID (= its process group).
:meth:`NetLab.kill` SIGKILLs a recorded group and, when given, the group a
mirrorq node recorded in its ``node.pid`` (its Thespian admin's group);
:meth:`NetLab.teardown` kills every group still recorded, then deletes
exactly the namespaces and the bridge the lab created (the veth pairs go
with their namespaces).  Nothing is ever found or killed by name.

Leftovers of a lab whose creating process died (a SIGKILLed test run) are
removed by :func:`cleanup_stale`: only names of this module's family
(``mqh<pid><letter>``) whose ``<pid>`` no longer runs.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

#: every name a lab creates starts with this
FAMILY = "mqh"
#: a lab's name: FAMILY, the creating process's PID, one letter (labs of one process)
_LAB_RE = re.compile(rf"^({FAMILY}(\d+)[a-z])")
SUBNET_PREFIX = "10.77"
#: seconds an ``ip``/``tc`` command may take
IP_TIMEOUT = 10.0
#: seconds a killed process group has to disappear
KILL_WAIT = 10.0
#: Linux's interface name limit (IFNAMSIZ - 1)
IFNAME_MAX = 15
#: node indices a lab supports (addresses .11-.99 and .101-.199)
MAX_NODES = 89

_letters = itertools.cycle("abcdefghijklmnopqrstuvwxyz")


class NetLabError(Exception):
    """A lab could not be created or changed; the message names the command."""


class NetemUnavailable(NetLabError):
    """The kernel has no netem qdisc (some minimal kernels are built without it)."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT)
    except FileNotFoundError:
        raise NetLabError(f"{argv[0]} is not installed (iproute2 is needed: apt-get install iproute2)") from None
    except subprocess.TimeoutExpired:
        raise NetLabError(f"{' '.join(argv)} did not finish within {IP_TIMEOUT:.0f}s") from None
    if check and cp.returncode != 0:
        raise NetLabError(f"{' '.join(argv)} failed (exit {cp.returncode}): {cp.stderr.strip()}")
    return cp


def unavailable() -> str:
    """Why a lab cannot be made on this machine ("" when it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 is needed: apt-get install iproute2)"
    cp = _run(["ip", "netns", "list"], check=False)
    if cp.returncode != 0:
        return f"ip netns does not work here: {cp.stderr.strip()}"
    return ""


def process_alive(pid: int) -> bool:
    from mirrorq.node.daemon import process_alive as alive

    return alive(pid)


def _group_alive(pgid: int) -> bool:
    from mirrorq.node.daemon import process_group_alive

    return process_group_alive(pgid)


def _used_subnets() -> set[int]:
    out = _run(["ip", "-4", "-o", "addr", "show"]).stdout
    used = set()
    for m in re.finditer(rf"inet {re.escape(SUBNET_PREFIX)}\.(\d+)\.", out):
        used.add(int(m.group(1)))
    return used


@dataclass
class NetLab:
    """A bridge and ``nodes`` namespaces (see the module docstring).  Use as
    a context manager, or call :meth:`create` and (always) :meth:`teardown`."""

    nodes: int
    name: str = ""
    subnet: int = -1
    #: node index -> its current host octet (10+i, or 100+i after a move)
    octets: dict[int, int] = field(default_factory=dict)
    #: PIDs (each its own process group) of what :meth:`spawn` started
    procs: dict[int, int] = field(default_factory=dict)
    #: nodes whose namespace holds :meth:`cut`'s filters
    cuts: set[int] = field(default_factory=set)
    _made_bridge: bool = False
    _made_ns: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"a lab has 1-{MAX_NODES} nodes, not {self.nodes}")
        if not self.name:
            self.name = f"{FAMILY}{os.getpid()}{next(_letters)}"
        if not _LAB_RE.match(self.name) or len(self.veth(self.nodes)) > IFNAME_MAX:
            raise ValueError(f"bad lab name {self.name!r}")

    # ---- names and addresses -----------------------------------------------
    def ns(self, i: int) -> str:
        return f"{self.name}-n{i}"

    def veth(self, i: int) -> str:
        """The root namespace's end of node ``i``'s pair (its namespace's end is ``eth0``)."""
        return f"{self.name}v{i}"

    @property
    def bridge(self) -> str:
        return f"{self.name}b"

    @property
    def gateway(self) -> str:
        """The bridge's address: where the root namespace's processes talk from."""
        return f"{SUBNET_PREFIX}.{self.subnet}.1"

    def address(self, i: int) -> str:
        """Node ``i``'s current address."""
        return f"{SUBNET_PREFIX}.{self.subnet}.{self.octets[i]}"

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{SUBNET_PREFIX}.{self.subnet}.0/24")

    # ---- building -----------------------------------------------------------------
    def create(self) -> NetLab:
        why = unavailable()
        if why:
            raise NetLabError(why)
        try:
            if self.subnet < 0:
                free = [s for s in range(256) if s not in _used_subnets()]
                if not free:
                    raise NetLabError(f"every {SUBNET_PREFIX}.S.0/24 is in use")
                self.subnet = free[0]
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._made_bridge = True
            _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            for i in range(1, self.nodes + 1):
                ns = self.ns(i)
                _run(["ip", "netns", "add", ns])
                self._made_ns.append(ns)
                _run(["ip", "link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns])
                _run(["ip", "link", "set", self.veth(i), "master", self.bridge])
                _run(["ip", "link", "set", self.veth(i), "up"])
                self.octets[i] = 10 + i
                _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"])
                _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        except BaseException:
            self.teardown()
            raise
        return self

    def move(self, i: int) -> str:
        """Give node ``i`` its other address (10+i <-> 100+i); returns the new one.
        Processes of the namespace keep running; their sockets on the old
        address stop working."""
        old = self.address(i)
        self.octets[i] = 100 + i if self.octets[i] == 10 + i else 10 + i
        # the old one goes first: deleting a subnet's primary address deletes its secondaries
        _run(["ip", "-n", self.ns(i), "addr", "del", f"{old}/24", "dev", "eth0"])
        _run(["ip", "-n", self.ns(i), "addr", "add", f"{self.address(i)}/24", "dev", "eth0"])
        return self.address(i)

    def set_link(self, i: int, delay_ms: float = 0.0, jitter_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """netem on both ends of node ``i``'s link (all zero: no qdisc)."""
        for prefix, dev in ((["ip", "netns", "exec", self.ns(i)], "eth0"), ([], self.veth(i))):
            if not (delay_ms or jitter_ms or loss_pct):
                _run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
                continue
            spec = ["delay", f"{delay_ms}ms"]
            if jitter_ms:
                spec.append(f"{jitter_ms}ms")
            if loss_pct:
                spec += ["loss", f"{loss_pct}%"]
            cp = _run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "netem", *spec], check=False)
            if cp.returncode != 0 and "qdisc kind is unknown" in cp.stderr:
                raise NetemUnavailable(
                    "tc netem is not available in this kernel (CONFIG_NET_SCH_NETEM, module sch_netem): "
                    "a lab link can get no delay, jitter or loss here"
                )
            if cp.returncode != 0:
                raise NetLabError(f"tc qdisc replace dev {dev} root netem {' '.join(spec)} failed: {cp.stderr.strip()}")

    # ---- faults ---------------------------------------------------------------------
    def cut(self, i: int, peers: list[int] | None = None, mode: str = "drop") -> None:
        """Cut node ``i`` off from ``peers`` (default: every other node) by
        packet filters inside its namespace, as a network failure would:
        ``drop`` (silent both ways: nothing arrives, nothing is refused),
        ``oneway`` (what node ``i`` sends to them is dropped, what they send
        arrives) or ``reject`` (both ways, answered with a TCP reset).  The
        root namespace (tools, a test's clients) still reaches node ``i``.
        :meth:`heal` undoes it.  Needs ``iptables``."""
        if mode not in ("drop", "oneway", "reject"):
            raise NetLabError(f"cut mode must be drop, oneway or reject, got {mode!r}")
        ipt = shutil.which("iptables") or "/usr/sbin/iptables"
        if not os.path.exists(ipt):
            raise NetLabError("iptables is not installed (ctl/install_iptables.sh installs it)")
        target = ["-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"] if mode == "reject" else ["-j", "DROP"]
        for j in peers if peers is not None else [k for k in self.octets if k != i]:
            prefix = ["ip", "netns", "exec", self.ns(i), ipt]
            _run([*prefix, "-A", "OUTPUT", "-d", self.address(j), *target])
            if mode != "oneway":
                _run([*prefix, "-A", "INPUT", "-s", self.address(j), *target])
            self.cuts.add(i)

    def heal(self, i: int | None = None) -> None:
        """Remove the filters :meth:`cut` put in node ``i``'s namespace (None: every node's)."""
        ipt = shutil.which("iptables") or "/usr/sbin/iptables"
        for k in [i] if i is not None else sorted(self.cuts):
            if k in self.cuts:
                for chain in ("INPUT", "OUTPUT"):
                    _run(["ip", "netns", "exec", self.ns(k), ipt, "-F", chain])
                self.cuts.discard(k)

    # ---- processes ------------------------------------------------------------------
    def spawn(self, i: int, argv: list[str], env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
        """Start ``argv`` inside node ``i``'s namespace, in a session of its own;
        its PID (= process group) is recorded for :meth:`kill`/:meth:`teardown`."""
        if i in self.procs and _group_alive(self.procs[i]):
            raise NetLabError(f"node {i} of lab {self.name} still runs a process (pgid {self.procs[i]})")
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], env=env, start_new_session=True, **popen)
        self.procs[i] = proc.pid
        return proc

    def signal(self, i: int, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the process :meth:`spawn` recorded for node ``i``."""
        pid = self.procs.get(i)
        if pid is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self, i: int, also_pgid: int | None = None) -> None:
        """SIGKILL node ``i``'s recorded process group and ``also_pgid`` (a
        group the process made, e.g. a mirrorq node's admin group); wait
        until both are gone."""
        groups = [g for g in (self.procs.pop(i, None), also_pgid) if g]
        for g in groups:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_WAIT
        while any(_group_alive(g) for g in groups):
            if time.monotonic() > deadline:
                raise NetLabError(f"process groups {groups} of lab {self.name} survived SIGKILL")
            time.sleep(0.02)  # polling interval of a condition with a deadline

    def teardown(self) -> None:
        """Kill every recorded process group, delete the namespaces and the
        bridge this lab created.  Safe to call more than once."""
        for i in list(self.procs):
            try:
                self.kill(i)
            except NetLabError:
                pass
        for i, ns in enumerate(list(self._made_ns), 1):
            # the pair goes now (with its namespace it would go when the kernel gets to it)
            _run(["ip", "link", "del", self.veth(i)], check=False)
            _run(["ip", "netns", "del", ns], check=False)
            self._made_ns.remove(ns)
        if self._made_bridge:
            _run(["ip", "link", "del", self.bridge], check=False)
            self._made_bridge = False

    def __enter__(self) -> NetLab:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.teardown()


def leftovers() -> tuple[list[str], list[str]]:
    """(namespaces, links) of this module's family in the root namespace."""
    ns = [ln.split()[0] for ln in _run(["ip", "netns", "list"]).stdout.splitlines() if ln.strip()]
    links = [
        ln.split()[0].split("@")[0] for ln in _run(["ip", "-br", "link", "show"]).stdout.splitlines() if ln.strip()
    ]
    return [n for n in ns if _LAB_RE.match(n)], [ln for ln in links if _LAB_RE.match(ln)]


def cleanup_stale() -> list[str]:
    """Delete namespaces and links of labs whose creating process is dead
    (only ``mqh<pid><letter>...`` names whose ``<pid>`` does not run).
    Processes still running in such a namespace are killed first, by the
    PIDs ``ip netns pids`` lists.  Returns what was deleted."""

    def stale(name: str) -> bool:
        m = _LAB_RE.match(name)
        return m is not None and not process_alive(int(m.group(2)))

    gone = []
    namespaces, links = leftovers()
    for name in filter(stale, links):  # veth pairs and bridges first: deleted now, not when the kernel gets to it
        _run(["ip", "link", "del", name], check=False)
        gone.append(name)
    for name in filter(stale, namespaces):
        for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run(["ip", "netns", "del", name], check=False)
        gone.append(name)
    return gone
