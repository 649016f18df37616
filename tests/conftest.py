"""Shared fixtures.  Real clusters are always stopped, even when a test fails,
and the session ends by checking that no process a test started is left."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ["THESPIAN_BASE_IPADDR"] = "127.0.0.1"
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"

# every data dir a test cluster used lives below this root, so leftovers are
# found by their command line (the node daemon's config path), never by name
_ROOT = Path(tempfile.mkdtemp(prefix="mirrorq-tests-"))


def processes_under(root: Path) -> list[int]:
    """PIDs whose command line names a path below ``root`` (node daemons,
    Thespian admins and actors forked from them)."""
    found = []
    needle = str(root).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle in f.read():
                    with open(f"/proc/{entry}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                            found.append(int(entry))
        except OSError:
            pass
    return found


def kill_pids(pids: list[int]) -> None:
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session", autouse=True)
def _no_process_left_behind():
    yield
    left = processes_under(_ROOT)
    kill_pids(left)
    if os.environ.get("MIRRORQ_KEEP_TEST_DATA") != "1":  # keep the nodes' logs to look at a failure
        shutil.rmtree(_ROOT, ignore_errors=True)
    assert not left, f"tests left node processes running: {left}"


_PORT_RNG = __import__("random").Random(os.getpid())


def free_port_block(n: int, start: int | None = None, end: int | None = None) -> int:
    """mirrorq.admin.cluster.free_port_block (ports in 10000-32000, below the ephemeral range)."""
    from mirrorq.admin.cluster import PORT_HI, PORT_LO
    from mirrorq.admin.cluster import free_port_block as free

    return free(n, PORT_LO if start is None else start, PORT_HI if end is None else end, _PORT_RNG)


@pytest.fixture
def fsyncs(monkeypatch):
    from mirrorq.fsapi import OsFileSystem

    """Every os.fsync call's fd, in order (group-fsync tests count them),
    the logs' (through mirrorq.fsapi.OS) included."""
    calls = []
    real = os.fsync

    def counting(fd):
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    # the logs call the file system they were given, by default the real one (mirrorq.fsapi.OS)
    monkeypatch.setattr(OsFileSystem, "fsync", staticmethod(counting))
    return calls


@pytest.fixture
def data_root() -> Path:
    d = Path(tempfile.mkdtemp(dir=_ROOT))
    yield d
    left = processes_under(d)
    kill_pids(left)
    assert not left, f"test left node processes running: {left}"


class LocalCluster:
    """A real cluster started through mirrorctl, for tests."""

    def __init__(self, data_dir: Path, nodes: int, interval: float, timeout: float):
        from mirrorq.admin.cluster import Cluster

        self.data_dir = data_dir
        self.interval, self.timeout = interval, timeout
        # one block for all three (admin, AMQP, then management ports): never overlapping
        self.base_port = free_port_block(3 * nodes + 2)
        self.amqp_base_port = self.base_port + nodes + 1
        self.management_base_port = self.amqp_base_port + nodes + 1
        self.cluster = Cluster(data_dir)
        self.nodes = nodes
        self.snapshot_every = 1000

    def ctl(self, *argv: str) -> int:
        from ctl.mirrorctl import main

        return main(["--data-dir", str(self.data_dir), *argv])

    def start(self) -> None:
        rc = self.ctl(
            "cluster",
            "start",
            "--nodes",
            str(self.nodes),
            "--base-port",
            str(self.base_port),
            "--amqp-base-port",
            str(self.amqp_base_port),
            "--management-base-port",
            str(self.management_base_port),
            "--heartbeat-interval",
            str(self.interval),
            "--heartbeat-timeout",
            str(self.timeout),
            "--registry-snapshot-every",
            str(self.snapshot_every),
        )
        assert rc == 0, "cluster start failed"

    def stop(self) -> None:
        self.cluster.stop_all()

    def admin_port(self, node: str) -> int:
        return int(self.cluster.pid_info(node)["admin_port"])

    def json(self, *argv: str):
        """``mirrorctl --formatter json ARGV`` that must succeed: its JSON (stdout captured here)."""
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = self.ctl("--formatter", "json", *argv)
        assert rc == 0, f"mirrorctl {' '.join(argv)} failed"
        return json.loads(out.getvalue())

    def queue_row(self, name: str, node: str = "node1") -> dict:
        """``list_queues`` as ``node`` sees it: the row of queue ``name`` ({} if none)."""
        rows = self.json(
            "list_queues", "-n", node, "name", "messages", "slave_pids", "synchronised_slave_pids", "state", "pid"
        )
        return next((r for r in rows if r["name"] == name), {})

    def wait_mirrored(self, name: str, node: str = "node1", mirrors: int = 2) -> None:
        """Until queue ``name`` has ``mirrors`` synchronised mirrors (as ``node`` sees it)."""
        wait_for(
            lambda: (
                len(self.queue_row(name, node).get("synchronised_slave_pids") or []) == mirrors,
                self.queue_row(name, node),
            ),
            30,
            f"{name} with {mirrors} synchronised mirrors",
        )

    @contextlib.contextmanager
    def channel(self, node: int = 0, confirm: bool = True):
        """A pika channel on node ``node``'s AMQP port (with publisher
        confirms unless ``confirm`` is False); its connection is closed after."""
        import pika

        conn = pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", self.amqp_base_port + node, blocked_connection_timeout=60)
        )
        try:
            ch = conn.channel()
            if confirm:
                ch.confirm_delivery()
            yield ch
        finally:
            with contextlib.suppress(Exception):
                conn.close()

    def ctl_json(self, capsys, *argv: str):
        """``mirrorctl --formatter json ARGV`` that must succeed; its JSON (None if it printed nothing)."""
        capsys.readouterr()
        rc = self.ctl("--formatter", "json", *argv)
        cap = capsys.readouterr()
        assert rc == 0, f"mirrorctl {' '.join(argv)} failed: {cap.err}"
        return json.loads(cap.out) if cap.out.strip() else None


def wait_for(pred, timeout: float, what: str, diagnostics=None):
    """Poll ``pred() -> (ok, last_seen)`` until ok (mirrorq.admin.cluster.poll); returns
    what it last saw, or fails naming ``what``, that, and ``diagnostics()``."""
    from mirrorq.admin.cluster import poll

    seen: dict = {}

    def probe():
        ok, seen["last"] = pred()
        return ok

    if poll(probe, timeout, step=0.1):
        return seen["last"]
    extra = diagnostics() if diagnostics is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last seen: {seen.get('last')}\n{extra}")


@contextlib.contextmanager
def nemesis_cluster(n: int = 3):
    """A started ``n``-node cluster whose nodes run in the nemesis' cgroups
    (ctl/nemesis/net.py: real packet filtering between nodes), as
    ``(cluster, nemesis)``; ``cluster.amqp_base_port`` is node1's AMQP port.
    On exit every rule, cgroup and process of it is gone."""
    from ctl.nemesis import net
    from mirrorq.admin.cluster import Cluster

    d = Path(tempfile.mkdtemp(dir=_ROOT))
    names = [f"node{i + 1}" for i in range(n)]
    nem = net.NetNemesis(names).open()
    cluster = Cluster(d)
    cluster.launch_prefix = lambda name: ["sh", "-c", 'echo $$ > "$0" && exec "$@"', nem.procs_file(name)]
    try:
        base = free_port_block(2 * n + 1)
        cluster.create(n, base, base + n + 1, 0.2, 1.5)
        for name in names:
            cluster.start_node(name)
        cluster.wait_all_up(names, 60)
        cluster.amqp_base_port = base + n + 1
        yield cluster, nem
    finally:
        nem.close()
        cluster.stop_all()
        kill_pids(processes_under(d))
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def running_cluster(nodes: int = 3, cls: type = LocalCluster, **kw):
    """A started cluster in a fresh data dir (for module-scoped fixtures);
    on exit it is stopped and no process of it may be left."""
    d = Path(tempfile.mkdtemp(dir=_ROOT))
    c = cls(d, nodes, interval=kw.pop("interval", 0.2), timeout=kw.pop("timeout", 1.5), **kw)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        left = processes_under(d)
        kill_pids(left)
        assert not left, f"left node processes running: {left}"


@pytest.fixture
def cluster3(data_root):
    c = LocalCluster(data_root, 3, interval=0.2, timeout=1.5)
    try:
        c.start()
        yield c
    finally:
        c.stop()
