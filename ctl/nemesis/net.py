"""Real packet filtering between the nodes of a local cluster: partitions that
drop silently or answer with TCP resets.

Why this way
------------
Every Thespian actor is its own process with its own dynamic listening port,
and every node of a local cluster lives on 127.0.0.1, so neither addresses nor
ports tell nodes apart.  Processes do: each node is started inside its own
**cgroup v2** (``/sys/fs/cgroup/unified/mqnem-<pid>/<node>``; the launcher's
``preexec`` hook moves the daemon there before it execs, and every process
the node forks -- the Thespian admin, each actor -- inherits it), and the
kernel tags every socket with the cgroup of the process that created it
(accepted sockets with their listener's).  iptables' ``-m cgroup --path``
matches that tag on locally generated packets.  That alone knows only the
*sender* of a packet, so the two ends of a connection are told apart with
**connmark** (all rules sit in the OUTPUT path, which every loopback packet
crosses once):

* a packet sent in the ORIGINAL direction by a socket of node *i* sets the
  connection's initiator byte (``mark & 0x00ff0000 = i << 16``); one sent in
  the REPLY direction by node *j* sets its responder byte
  (``mark & 0xff000000 = j << 24``).  Thespian answers every message with an
  ACK packet, so every connection that carried one message is fully marked.
  These marking rules are installed *before* the nodes start.
* a partition between *a* and *b* drops (or REJECTs with ``tcp-reset``) every
  packet of a connection marked (a, b) or (b, a), and -- for connections
  opened while it holds, whose responder has not spoken yet -- every packet
  a socket of *a* sends to a listening port of *b*.  Those ports are read
  from ``/proc`` (the LISTEN sockets of the processes in *b*'s cgroup) when
  the partition starts and re-read every ``refresh`` seconds while it holds.
  A new actor created on *b* during the partition can only be addressed
  from *a* after its address crossed the partition, so the refresh closes a
  window that only a message already through the cut could open.

Why not the alternatives: cgroup v1 ``net_cls`` is not mounted here, and
mounting it turns off cgroup v2 socket matching for the whole machine (other
engineers' work); uid-owner matching sees only the sender too and needs a
user per node; network namespaces need a non-loopback address per node,
which the launcher, the tests and the clients do not use.  INPUT-side
cgroup matching does not work on loopback (the kernel does no early socket
demux there), which is why the listener ports are needed.

Clients (pika, mirrorctl, the tests) are in no node's cgroup: a partition
never cuts a client from a node (Jepsen's partitions cut nodes from nodes).

Cleanup
-------
Everything is named after the owning process: the cgroup tree
``mqnem-<pid>``, the chains ``MQNEM-<pid>`` (marking) and ``MQNEM-<pid>-P``
(the current partition), jumped to from OUTPUT.  :meth:`NetNemesis.close`
removes them (it runs from ``finally`` blocks and is idempotent), and
:func:`cleanup_leftovers` -- run by :meth:`NetNemesis.open` -- removes those
of owners that are no longer alive (a run killed with -9), and only those:
another engineer's run on the same machine is left alone.

Assumes root, ``iptables`` (installed by ``ctl/install_iptables.sh``) and a
writable cgroup v2 hierarchy; :func:`available` says whether they are there
and why not.  A failing iptables command raises :class:`NetError` naming it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field

from mirrorq.node.daemon import process_alive

CGROUP2_CANDIDATES = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")
PREFIX = "mqnem-"
CHAIN_PREFIX = "MQNEM-"
INIT_MASK, RESP_MASK = 0x00FF0000, 0xFF000000
MULTIPORT_MAX = 15


class NetError(RuntimeError):
    pass


def cgroup2_root() -> str | None:
    for path in CGROUP2_CANDIDATES:
        try:
            with open("/proc/mounts") as f:
                mounts = [line.split() for line in f]
        except OSError:
            return None
        if any(m[1] == path and m[2] == "cgroup2" for m in mounts if len(m) > 2):
            return path
    return None


def iptables() -> str | None:
    return shutil.which("iptables") or (os.path.exists("/usr/sbin/iptables") and "/usr/sbin/iptables") or None


def available() -> tuple[bool, str]:
    """(ok, why not): root, iptables, a writable cgroup v2 hierarchy."""
    if os.geteuid() != 0:
        return False, "partitions need root (iptables, cgroups)"
    ipt = iptables()
    if not ipt:
        return False, "iptables is not installed (ctl/install_iptables.sh installs it)"
    root = cgroup2_root()
    if root is None:
        return False, "no cgroup v2 hierarchy mounted"
    if not os.access(root, os.W_OK):
        return False, f"{root} is not writable"
    r = subprocess.run([ipt, "-w", "-S", "OUTPUT"], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"iptables does not work here: {r.stderr.strip()}"
    return True, ""


def _ipt(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([iptables() or "iptables", "-w", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetError(f"iptables {' '.join(args)}: {r.stderr.strip()}")
    return r


def _remove_chain(chain: str) -> None:
    sub = chain + "-P"
    for c in (chain,):
        while _ipt("-D", "OUTPUT", "-j", c, check=False).returncode == 0:
            pass
    for c in (chain, sub):
        _ipt("-F", c, check=False)
    for c in (chain, sub):
        _ipt("-X", c, check=False)


def _remove_cgroup_tree(path: str, root: str) -> None:
    """Move any process left in ``path``'s children to the root cgroup, then rmdir."""
    if not os.path.isdir(path):
        return
    for sub in sorted(os.listdir(path)):
        p = os.path.join(path, sub)
        if os.path.isdir(p):
            _remove_cgroup_tree(p, root)
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            pids = [int(x) for x in f.read().split()]
    except OSError:
        pids = []
    for pid in pids:
        try:
            with open(os.path.join(root, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def cleanup_leftovers() -> list[str]:
    """Remove the chains and cgroups of nemesis runs whose owner process is
    dead; return what was removed."""
    removed = []
    if iptables():
        r = _ipt("-S", check=False)
        for m in re.finditer(rf"^-N ({CHAIN_PREFIX}(\d+))$", r.stdout, re.M):
            if not process_alive(int(m.group(2))):
                _remove_chain(m.group(1))
                removed.append(m.group(1))
    root = cgroup2_root()
    if root and os.path.isdir(root):
        for entry in os.listdir(root):
            owned = re.fullmatch(rf"{PREFIX}(\d+)", entry)
            if owned and not process_alive(int(owned.group(1))):
                _remove_cgroup_tree(os.path.join(root, entry), root)
                removed.append(os.path.join(root, entry))
    return removed


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(int(link[8:-1]))
    except OSError:
        pass
    return out


def _listening_ports_by_inode() -> dict[int, int]:
    """inode -> port of every IPv4/IPv6 TCP socket in LISTEN state."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if len(parts) > 9 and parts[3] == "0A":
                        out[int(parts[9])] = int(parts[1].rsplit(":", 1)[1], 16)
        except (OSError, StopIteration):
            pass
    return out


@dataclass
class Partition:
    """The nodes cut from each other (every pair across two different groups),
    or, ``one_way``, only what the first group sends to the others."""

    groups: tuple[frozenset[str], ...]
    mode: str  # "drop" | "reset"
    installed: set = field(default_factory=set)  # (src node, port) drop rules in place
    one_way: bool = False

    def pairs(self) -> list[tuple[str, str]]:
        out = []
        for i, a_grp in enumerate(self.groups):
            for b_grp in self.groups[i + 1 :]:
                for a in sorted(a_grp):
                    for b in sorted(b_grp):
                        out.append((a, b))
        return out

    def directions(self) -> list[tuple[str, str]]:
        """(sender, receiver) pairs whose packets are cut."""
        pairs = self.pairs()
        return pairs if self.one_way else pairs + [(b, a) for a, b in pairs]


class NetNemesis:
    """Cgroups per node plus the iptables chains that cut them.

    ``open()`` makes the cgroups and the marking rules (before the nodes
    start); :meth:`preexec` gives a ``subprocess`` ``preexec_fn`` that moves a
    node's daemon into its cgroup; :meth:`partition` / :meth:`heal` cut and
    restore; :meth:`close` removes everything."""

    def __init__(self, nodes: list[str], refresh: float = 0.5):
        self.nodes = list(nodes)
        self.index = {n: i + 1 for i, n in enumerate(self.nodes)}  # 1..255
        if len(self.nodes) > 254:
            raise NetError("at most 254 nodes")
        self.owner = os.getpid()
        self.root = cgroup2_root() or CGROUP2_CANDIDATES[0]
        self.rel = f"{PREFIX}{self.owner}"
        self.base = os.path.join(self.root, self.rel)
        self.chain = f"{CHAIN_PREFIX}{self.owner}"
        self.pchain = self.chain + "-P"
        self.refresh = refresh
        self.current: Partition | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._opened = False

    # ---- lifecycle -----------------------------------------------------------
    def open(self) -> NetNemesis:
        ok, why = available()
        if not ok:
            raise NetError(why)
        cleanup_leftovers()
        try:
            os.makedirs(self.base, exist_ok=True)
            for n in self.nodes:
                os.makedirs(os.path.join(self.base, n), exist_ok=True)
            self._opened = True
            _remove_chain(self.chain)
            _ipt("-N", self.chain)
            _ipt("-N", self.pchain)
            for n, i in self.index.items():
                path = f"{self.rel}/{n}"
                _ipt(
                    "-A",
                    self.chain,
                    "-m",
                    "conntrack",
                    "--ctdir",
                    "ORIGINAL",
                    "-m",
                    "cgroup",
                    "--path",
                    path,
                    "-j",
                    "CONNMARK",
                    "--set-xmark",
                    f"{i << 16:#x}/{INIT_MASK:#x}",
                )
                _ipt(
                    "-A",
                    self.chain,
                    "-m",
                    "conntrack",
                    "--ctdir",
                    "REPLY",
                    "-m",
                    "cgroup",
                    "--path",
                    path,
                    "-j",
                    "CONNMARK",
                    "--set-xmark",
                    f"{i << 24:#x}/{RESP_MASK:#x}",
                )
            _ipt("-A", self.chain, "-j", self.pchain)
            _ipt("-I", "OUTPUT", "1", "-j", self.chain)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        if not self._opened:
            return
        with self._lock:
            self.current = None
            _remove_chain(self.chain)
            _remove_cgroup_tree(self.base, self.root)
            self._opened = False

    def __enter__(self) -> NetNemesis:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def leftovers(self) -> list[str]:
        """What of this run is still in place (a test asserts it is nothing after close)."""
        out = []
        if os.path.exists(self.base):
            out.append(self.base)
        r = _ipt("-S", check=False)
        out += [c for c in (self.chain, self.pchain) if re.search(rf"^-N {re.escape(c)}$", r.stdout, re.M)]
        return out

    # ---- processes -----------------------------------------------------------
    def procs_file(self, node: str) -> str:
        return os.path.join(self.base, node, "cgroup.procs")

    def preexec(self, node: str):
        """A ``preexec_fn``: the child joins ``node``'s cgroup before it execs."""
        path = self.procs_file(node)

        def join() -> None:
            with open(path, "w") as f:
                f.write(str(os.getpid()))

        return join

    def pids(self, node: str) -> list[int]:
        try:
            with open(self.procs_file(node)) as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def listen_ports(self, node: str) -> set[int]:
        by_inode = _listening_ports_by_inode()
        ports = set()
        for pid in self.pids(node):
            for ino in _socket_inodes(pid):
                if ino in by_inode:
                    ports.add(by_inode[ino])
        return ports

    # ---- partitions ----------------------------------------------------------
    def _target(self, mode: str) -> list[str]:
        return ["DROP"] if mode == "drop" else ["REJECT", "--reject-with", "tcp-reset"]

    def partition(
        self, groups: list[set[str]] | list[list[str]], mode: str = "drop", one_way: bool = False
    ) -> Partition:
        """Cut every node of one group from every node of the others.  ``mode``
        'drop': packets vanish (a silent partition); 'reset': each packet is
        answered with a TCP reset (connections fail at once).  ``one_way``:
        only the packets the first group's nodes send to the others are cut
        (an asymmetric partition: the others' packets still arrive, their
        TCP connections to the first group fail on the answers)."""
        if mode not in ("drop", "reset"):
            raise ValueError(f"mode must be drop or reset, got {mode!r}")
        groups_t = tuple(frozenset(g) for g in groups)
        unknown = set().union(*groups_t) - set(self.nodes)
        if unknown:
            raise ValueError(f"unknown nodes {sorted(unknown)}")
        with self._lock:
            self.heal()
            p = Partition(groups_t, mode, one_way=one_way)
            tgt = self._target(mode)
            if mode == "reset":
                # the resets REJECT sends cross OUTPUT too: let them through
                _ipt("-A", self.pchain, "-p", "tcp", "--tcp-flags", "RST", "RST", "-j", "RETURN")
            for a, b in p.pairs():
                ia, ib = self.index[a], self.index[b]
                for x, y in ((ia, ib), (ib, ia)):
                    sender = ["-m", "cgroup", "--path", f"{self.rel}/{a}"] if one_way else []
                    _ipt(
                        "-A",
                        self.pchain,
                        *sender,
                        "-p",
                        "tcp",
                        "-m",
                        "connmark",
                        "--mark",
                        f"{(x << 16) | (y << 24):#x}/{INIT_MASK | RESP_MASK:#x}",
                        "-j",
                        *tgt,
                    )
            self.current = p
            self._add_port_rules(p)
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._refresher, name="nemesis-net-refresh", daemon=True)
            self._thread.start()
        return p

    def _add_port_rules(self, p: Partition) -> None:
        tgt = self._target(p.mode)
        for src, dst in p.directions():
            new = sorted(port for port in self.listen_ports(dst) if (src, port) not in p.installed)
            for i in range(0, len(new), MULTIPORT_MAX):
                chunk = new[i : i + MULTIPORT_MAX]
                _ipt(
                    "-A",
                    self.pchain,
                    "-m",
                    "cgroup",
                    "--path",
                    f"{self.rel}/{src}",
                    "-p",
                    "tcp",
                    "-m",
                    "multiport",
                    "--dports",
                    ",".join(map(str, chunk)),
                    "-j",
                    *tgt,
                )
                p.installed.update((src, port) for port in chunk)

    def _refresher(self) -> None:
        while not self._stop.wait(self.refresh):
            with self._lock:
                if self.current is not None and self._opened:
                    try:
                        self._add_port_rules(self.current)
                    except NetError:
                        pass  # a racing heal/close flushed the chain

    def heal(self) -> None:
        with self._lock:
            if self._opened:
                _ipt("-F", self.pchain)
            self.current = None

    def rules(self) -> str:
        return _ipt("-S", self.pchain, check=False).stdout
