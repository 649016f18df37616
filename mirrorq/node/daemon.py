"""Start one node: ``python -m mirrorq.node.daemon NODE.yaml``.

Checks the config, the data dir and the ports, then starts a Thespian
``multiprocTCPBase`` actor system on the node's admin port (the admin
double-forks and becomes the leader of its own process group), creates the
node agent, the queue manager, the AMQP listener and the management
supervisor (:mod:`mirrorq.mgmt.supervisor`), writes ``node.pid`` (JSON:
name, pgid, pid, ports) into the node's data dir and exits 0.  The node
lives on in the admin's process group; kill that group to kill the node.

Every failure is one line on stderr starting with ``mirrorq node:`` and a
non-zero exit, with nothing left running: the daemon makes itself a child
subreaper (``PR_SET_CHILD_SUBREAPER``) before it starts the actor system, so
the admin Thespian double-forks (and everything the admin forks) stays its
descendant until it exits; on any failure -- an exception, a start that
does not finish, SIGTERM from the launcher's deadline -- it SIGKILLs the
process group of every descendant (:func:`kill_descendants`).  As soon as
the admin exists its group goes into ``node.pid`` (``"starting": true``), so
even a daemon killed with -9 mid-start leaves a group ``cluster stop`` and
``kill_node`` find by its recorded pgid.

The admin inherits this process's stdout and stderr, so after the checks they
are pointed at ``<data_dir>/daemon.out``: a daemon never writes to a terminal.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import signal
import socket
import sys
import time
from typing import Any

from mirrorq.node import loop_select, posting, wire
from mirrorq.node.config import ConfigError, NodeConfig, load
from mirrorq.node.messages import AGENT_GLOBAL_NAME, NODE_CAPABILITY, NodeInit, NodeReady
from mirrorq.stack_room import run_with_room

START_TIMEOUT = 15.0

#: allocations (net of frees) between two young collections: CPython's 700
#: makes a turn's working set (a batch of deliveries, its frames and
#: events) be traced and promoted several times before it dies of its
#: reference count at the end of the turn
GC_YOUNG = 20_000


class StartError(Exception):
    pass


def tune_gc() -> None:
    """The collector settings every node process inherits.

    Young collections every :data:`GC_YOUNG` allocations.  And every process
    forked from here (the admin, and each actor the admin forks) freezes
    what it inherited (``gc.freeze``: modules, classes, Thespian's state),
    so a full collection in the child traces only what the child made.
    Objects frozen that later become cyclic garbage are not collected: the
    inherited state is the parent's, which a child does not drop."""
    gc.set_threshold(GC_YOUNG, 10, 10)
    os.register_at_fork(after_in_child=gc.freeze)


def check_port_free(host: str, port: int, what: str) -> None:
    # Thespian binds 0.0.0.0 for its listen sockets: check both.
    for addr in ("0.0.0.0", host):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # as Thespian does: connections of a previous life in TIME_WAIT must
        # not block a restart, a live listener must
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise StartError(f"{what} port {port} is already in use") from None
            raise StartError(f"{what} port {port} cannot be bound on {addr}: {e.strerror}") from None
        finally:
            s.close()


def load_secret(cfg: NodeConfig) -> bytes:
    """The cluster secret named by ``secret_file`` (required, mode 0600)."""
    if not cfg.secret_file:
        raise StartError(
            f"node {cfg.name}: no secret_file in its config: inter-node messages must carry "
            "the cluster's shared secret (mirrorctl cluster start writes one)"
        )
    try:
        return wire.read_secret(cfg.secret_file)
    except (OSError, ValueError) as e:
        raise StartError(f"node {cfg.name}: cluster secret: {e}") from None


def check_data_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write-test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise StartError(f"data dir {path} is not writable: {e.strerror or e}") from None


def pid_file(data_dir: str) -> str:
    return os.path.join(data_dir, "node.pid")


def read_pid_file(data_dir: str) -> dict | None:
    try:
        with open(pid_file(data_dir)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a group whose only members are zombies is dead for our purposes
    return any(_state(pid) not in (None, "Z") for pid in _group_members(pgid))


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def group_rss(pgid: int) -> int:
    """Resident bytes of every process of a process group (a node's: its
    admin, actors, shells and management server)."""
    total = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for pid in _group_members(pgid):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total


def group_fds(pgid: int) -> dict[str, int]:
    """A process group's open files: ``proc_used`` (its processes),
    ``fd_used`` (descriptors of them all), ``sockets_used`` (of which
    sockets) and ``fd_total`` (the lowest per-process ``Max open files``
    soft limit among them; 0 if unknown) -- what RabbitMQ's /api/nodes calls
    them.  Processes that vanish or cannot be read are skipped."""
    procs = fds = sockets = 0
    limit = 0
    for pid in _group_members(pgid):
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        procs += 1
        fds += len(names)
        for n in names:
            try:
                sockets += os.readlink(f"/proc/{pid}/fd/{n}").startswith("socket:")
            except OSError:
                continue
        try:
            with open(f"/proc/{pid}/limits") as f:
                line = next((ln for ln in f if ln.startswith("Max open files")), "")
            soft = line.split()[3] if line else ""
            if soft.isdigit():
                limit = min(limit, int(soft)) if limit else int(soft)
        except (OSError, IndexError):
            pass
    return {"proc_used": procs, "fd_used": fds, "sockets_used": sockets, "fd_total": limit}


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def kill_group(pgid: int, timeout: float = 5.0) -> bool:
    """SIGKILL a whole process group and wait until no live member is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_group_alive(pgid):
            return True
        time.sleep(0.02)
    return not process_group_alive(pgid)


def become_subreaper() -> bool:
    """Orphaned descendants re-parent to this process (Linux prctl)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _ppid_pgid(pid: int) -> tuple[int, int] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def descendants(root: int | None = None) -> list[int]:
    """PIDs below ``root`` (default: this process) in the process tree."""
    root = os.getpid() if root is None else root
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            pp = _ppid_pgid(int(entry))
            if pp:
                parent[int(entry)] = pp[0]
    out, frontier = [], {root}
    while frontier:
        kids = {p for p, pp in parent.items() if pp in frontier and p not in out}
        out.extend(sorted(kids))
        frontier = kids
    return out


def admin_pgid() -> int | None:
    """The process group of the admin this daemon started (the group of a
    descendant outside ours: the admin's first fork calls setsid and exits,
    so the group usually has no leader any more), or None."""
    mine = os.getpgid(0)
    for pid in descendants():
        pp = _ppid_pgid(pid)
        if pp and pp[1] != mine and _state(pid) not in (None, "Z"):
            return pp[1]
    return None


def kill_descendants(timeout: float = 5.0) -> None:
    """SIGKILL every descendant's process group (and the descendant), wait for them."""
    mine = os.getpgid(0)
    for _ in range(3):
        pids = descendants()
        if not pids:
            return
        for pid in pids:
            pp = _ppid_pgid(pid)
            try:
                if pp and pp[1] != mine:
                    os.killpg(pp[1], signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # reap the zombies that are our children now
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                pass
            if not [p for p in descendants() if _state(p) not in (None, "Z")]:
                return
            time.sleep(0.02)


class _Terminated(BaseException):
    pass


def _on_term(signum, frame):
    raise _Terminated(f"signal {signum}")


def _write_pid_file(data_dir: str, info: dict) -> None:
    tmp = pid_file(data_dir) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, pid_file(data_dir))


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def start(cfg: NodeConfig) -> dict:
    """Start the node described by ``cfg``; return what went into node.pid."""
    return launch(cfg)[0]


def launch(cfg: NodeConfig) -> tuple[dict, Any]:
    """:func:`start`, also returning the actor system this process started
    the node with (:mod:`mirrorq.server` keeps it to stop the node)."""
    check_data_dir(cfg.data_dir)
    old = read_pid_file(cfg.data_dir)
    if old and process_group_alive(old.get("pgid", -1)):
        raise StartError(f"node {cfg.name} is already running (pgid {old['pgid']})")
    from mirrorq.classic.actor import TRANSIENT_DIR

    # non-durable queues' logs never outlive the node that wrote them
    shutil.rmtree(os.path.join(cfg.data_dir, TRANSIENT_DIR), ignore_errors=True)
    check_port_free(cfg.host, cfg.admin_port, "admin")
    check_port_free(cfg.host, cfg.amqp_port, "AMQP")
    if cfg.amqps_port:
        check_port_free(cfg.host, cfg.amqps_port, "AMQPS")
    if cfg.management_port:
        check_port_free(cfg.host, cfg.management_port, "management")
    secret = load_secret(cfg)

    os.environ["THESPIAN_BASE_IPADDR"] = cfg.host
    os.environ["THESPLOG_FILE"] = os.path.join(cfg.data_dir, "thespian.log")
    os.environ.setdefault("THESPLOG_FILE_MAXSIZE", str(4 << 20))
    os.environ.setdefault("THESPLOG_THRESHOLD", "WARNING")
    out = os.open(os.path.join(cfg.data_dir, "daemon.out"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    # the admin forks from this process: it must not keep our caller's stderr
    # (a pipe in mirrorctl) open, or the caller would wait for it forever
    os.register_at_fork(after_in_child=lambda: _close_quietly(saved))
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)

    from thespian.actors import ActorSystem

    # every listen socket on cfg.host only, every message MAC'd with the
    # cluster secret, checked before unpickling (the admin and every actor
    # are forked from this process and inherit it): see mirrorq.node.wire
    wire.install(secret, bind_host=cfg.host)
    loop_select.install()
    posting.install_transmit_bounds()
    asys = None
    ready = None
    become_subreaper()
    tune_gc()
    old_term = signal.signal(signal.SIGTERM, _on_term)
    try:
        asys = ActorSystem(
            "multiprocTCPBase",
            {"Admin Port": cfg.admin_port, NODE_CAPABILITY: cfg.name, "mirrorq.host": cfg.host},
            transientUnique=True,
        )
        pg = admin_pgid()
        if pg is not None:
            _write_pid_file(
                cfg.data_dir,
                {
                    "name": cfg.name,
                    "pgid": pg,
                    "starting": True,
                    "daemon_pid": os.getpid(),
                    "admin_port": cfg.admin_port,
                    "amqp_port": cfg.amqp_port,
                    "host": cfg.host,
                    "started": time.time(),
                },
            )
        if os.environ.get("MIRRORQ_TEST_START_HOLD"):
            # test hook (tests/cluster/test_orphans.py): stay mid-start, admin
            # running, so that a test can interrupt a start deterministically
            time.sleep(float(os.environ["MIRRORQ_TEST_START_HOLD"]))
        agent = asys.createActor("mirrorq.node.agent.NodeAgent", globalName=AGENT_GLOBAL_NAME)
        ready = asys.ask(agent, NodeInit(cfg.to_dict()), START_TIMEOUT)
        if not isinstance(ready, NodeReady):
            raise StartError(f"node {cfg.name}: the node agent did not answer within {START_TIMEOUT:.0f}s")
        from mirrorq.queues.manager import MANAGER_GLOBAL_NAME, ManagerInit

        manager = asys.createActor("mirrorq.queues.manager.QueueManager", globalName=MANAGER_GLOBAL_NAME)
        asys.tell(manager, ManagerInit(cfg.to_dict(), agent))
        from mirrorq.amqp.listener import LISTENER_GLOBAL_NAME, ListenerInit

        # amqp_shell: the ThespianWatch listener, or the bridge actor that
        # starts the asyncio shell process (in this node's process group)
        shell_class = {"watch": "mirrorq.amqp.listener.AMQPListener", "asyncio": "mirrorq.amqp.bridge.AMQPBridge"}[
            cfg.amqp_shell
        ]
        listener = asys.createActor(shell_class, globalName=LISTENER_GLOBAL_NAME)
        amqp = asys.ask(listener, ListenerInit(cfg.to_dict(), agent, manager), START_TIMEOUT)
        if not getattr(amqp, "ok", False):
            raise StartError(f"node {cfg.name}: AMQP listener did not start: {getattr(amqp, 'error', 'no answer')}")
        if cfg.management_port:
            # the HTTP management server: a process the supervisor starts (in
            # this node's process group) and restarts; not waited for, so a
            # node's start does not pay its imports (see mirrorq.mgmt.supervisor)
            from mirrorq.mgmt.supervisor import SUPERVISOR_GLOBAL_NAME, MgmtInit

            mgmt = asys.createActor("mirrorq.mgmt.supervisor.MgmtSupervisor", globalName=SUPERVISOR_GLOBAL_NAME)
            asys.tell(mgmt, MgmtInit(cfg.to_dict()))
    except BaseException as e:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if asys is not None and not isinstance(e, _Terminated):
            try:
                asys.shutdown()
            except BaseException:
                pass
        # whatever shutdown left (or never reached): every group we started
        kill_descendants()
        try:
            os.remove(pid_file(cfg.data_dir))
        except FileNotFoundError:
            pass
        os.dup2(saved, 2)
        if isinstance(e, StartError):
            raise
        if isinstance(e, _Terminated):
            raise StartError(f"node {cfg.name}: start interrupted ({e}); nothing left running") from None
        raise StartError(f"node {cfg.name}: actor system failed to start: {e}") from None
    signal.signal(signal.SIGTERM, old_term)
    os.dup2(saved, 2)
    info = {
        "name": cfg.name,
        "pgid": ready.pgid,
        "agent_pid": ready.pid,
        "incarnation": ready.incarnation,
        "admin_port": cfg.admin_port,
        "amqp_port": cfg.amqp_port,
        "management_port": cfg.management_port,
        "amqps_port": cfg.amqps_port,
        "host": cfg.host,
        "started": time.time(),
    }
    _write_pid_file(cfg.data_dir, info)
    return info, asys


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (the
    node's processes inherit it): a queue host keeps each of its replicas'
    store files open, and a default soft limit of 1024 would cap a node at a
    few hundred queues.  Returns the limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    raise_open_files_limit()
    if len(argv) != 1:
        print("usage: python -m mirrorq.node.daemon NODE.yaml", file=sys.stderr)
        return 2
    try:
        cfg = load(argv[0])
        # the admin and every actor are forked below this call: their
        # turns run in its chunk of frame stack (mirrorq.stack_room)
        run_with_room(start, cfg)
    except (ConfigError, StartError) as e:
        print(f"mirrorq node: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
