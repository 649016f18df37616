"""A mirrorq cluster in a :class:`~mirrorq.admin.netns.NetLab`: one node per
network namespace, each run by ``mirrorq-server`` (:mod:`mirrorq.server`)
from its own config file, as on separate hosts.

:class:`LabCluster` writes the nodes' configs (every node on its own
address, the same ports, the others' admin addresses as seeds, one shared
secret), starts each node's server inside its namespace, and reaches the
cluster from the root namespace over the lab's bridge
(:class:`~mirrorq.admin.remote.RemoteCluster`; pika connects to
:meth:`LabCluster.amqp_address`).  :meth:`LabCluster.kill` is ``kill -9``
of the node (its server's process group and its admin's, both recorded);
:meth:`LabCluster.stop` is SIGTERM to its server (a graceful stop);
:meth:`LabCluster.move` gives a stopped node's namespace a new address and
rewrites its config (same name, same data dir).  :meth:`LabCluster.close`
stops every node and tears the lab down, whatever happened before.

As a command it runs a lab cluster in the foreground until SIGINT or
SIGTERM (for trying things by hand and for benchmarks)::

    python -m mirrorq.admin.lab --nodes 3 --data-dir /tmp/lab [--delay-ms 1 --jitter-ms 0.1 --loss-pct 0]
    python -m mirrorq.admin.lab --cleanup      # delete leftovers of dead labs (names mqh<pid>...)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from mirrorq.admin.cluster import ClusterError, poll
from mirrorq.admin.netns import NetLab, NetLabError, cleanup_stale
from mirrorq.node import daemon, wire
from mirrorq.node.config import NodeConfig

#: every node of a lab listens on these (each in its own namespace)
ADMIN_PORT, AMQP_PORT, MANAGEMENT_PORT = 19500, 5672, 15672
#: seconds a node's server has to print that it runs
START_TIMEOUT = daemon.START_TIMEOUT + 30
#: seconds a SIGTERMed server has to exit (its own stop is bounded by mirrorq.server.STOP_TIMEOUT)
STOP_TIMEOUT = 30.0


class LabCluster:
    def __init__(
        self,
        nodes: int,
        data_dir: str | os.PathLike,
        management: bool = False,
        queue_hosts: int = 1,
        heartbeat_interval: float = 0.2,
        heartbeat_timeout: float = 1.5,
    ):
        self.lab = NetLab(nodes)
        self.data_dir = Path(data_dir)
        self.names = [f"node{i}" for i in range(1, nodes + 1)]
        self.management = management
        self.queue_hosts = queue_hosts
        self.heartbeat = (heartbeat_interval, heartbeat_timeout)
        self.procs: dict[int, subprocess.Popen] = {}
        self.secret = Path()

    # ---- setup ---------------------------------------------------------------------------
    def open(self) -> LabCluster:
        try:
            self.lab.create()
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self.secret = wire.create_secret(self.data_dir)
            wire.use_secret_file(self.secret)  # this process talks to the nodes
            for i in range(1, len(self.names) + 1):
                self.write_config(i)
        except BaseException:
            self.close()
            raise
        return self

    def index(self, name: str) -> int:
        return self.names.index(name) + 1

    def config_path(self, i: int) -> Path:
        return self.data_dir / f"{self.names[i - 1]}.yaml"

    def node_dir(self, i: int) -> Path:
        return self.data_dir / self.names[i - 1]

    def write_config(self, i: int) -> NodeConfig:
        """Node ``i``'s config at its current address; seeds: the others' current addresses."""
        cfg = NodeConfig(
            name=self.names[i - 1],
            host=self.lab.address(i),
            admin_port=ADMIN_PORT,
            amqp_port=AMQP_PORT,
            management_port=MANAGEMENT_PORT if self.management else 0,
            data_dir=str(self.node_dir(i)),
            seeds=tuple(f"{self.lab.address(j)}:{ADMIN_PORT}" for j in range(1, len(self.names) + 1) if j != i),
            heartbeat_interval=self.heartbeat[0],
            heartbeat_timeout=self.heartbeat[1],
            cluster_nodes=tuple(self.names),
            secret_file=str(self.secret),
            queue_hosts=self.queue_hosts,
        )
        self.node_dir(i).mkdir(parents=True, exist_ok=True)
        cfg.dump(self.config_path(i))
        return cfg

    # ---- nodes -----------------------------------------------------------------------------
    def start(self, *nodes: int) -> None:
        """Start the servers of ``nodes`` (default: all) in their namespaces,
        all at once; return once each runs (its ``running`` line), or kill
        them and raise with the end of the output of one that did not."""
        nodes = nodes or tuple(range(1, len(self.names) + 1))
        marks = {i: self._spawn(i) for i in nodes}

        def running(i: int) -> bool:
            with open(self.node_dir(i) / "server.out", "rb") as f:
                f.seek(marks[i])
                return b" running on " in f.read()

        poll(lambda: all(running(i) or self.procs[i].poll() is not None for i in nodes), START_TIMEOUT)
        bad = [i for i in nodes if not running(i)]
        if bad:
            tail = (self.node_dir(bad[0]) / "server.out").read_text(errors="replace")[-2000:]
            for i in nodes:
                self.kill(i)
            raise ClusterError(f"{self.names[bad[0] - 1]} did not start in lab {self.lab.name}:\n{tail}")

    def _spawn(self, i: int) -> int:
        """Start node ``i``'s server; the offset in its server.out where this run's output starts."""
        out = self.node_dir(i) / "server.out"
        env = {**os.environ, "THESPIAN_BASE_IPADDR": self.lab.address(i)}
        here = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
        with open(out, "ab") as f:
            mark = f.tell()
            self.procs[i] = self.lab.spawn(
                i,
                [sys.executable, "-m", "mirrorq.server", "--config", str(self.config_path(i))],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        return mark

    def admin_pgid(self, i: int) -> int | None:
        rec = daemon.read_pid_file(str(self.node_dir(i))) or {}
        return int(rec["pgid"]) if "pgid" in rec else None

    def kill(self, i: int) -> None:
        """``kill -9`` of node ``i``: its server's process group and its admin's."""
        self.lab.kill(i, self.admin_pgid(i))
        proc = self.procs.pop(i, None)
        if proc is not None:
            proc.wait(timeout=STOP_TIMEOUT)

    def stop(self, i: int) -> int | None:
        """SIGTERM to node ``i``'s server (a graceful stop); its exit code.
        Past :data:`STOP_TIMEOUT` it is killed (and None returned)."""
        proc = self.procs.get(i)
        if proc is None:
            return None
        self.lab.signal(i, signal.SIGTERM)
        try:
            rc = proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = None
        self.kill(i)
        return rc

    def move(self, i: int) -> str:
        """Give stopped node ``i`` its other address and rewrite its config."""
        if i in self.procs and self.procs[i].poll() is None:
            raise ClusterError(f"{self.names[i - 1]} is running: stop it before moving it")
        addr = self.lab.move(i)
        self.write_config(i)
        return addr

    def amqp_address(self, i: int) -> tuple[str, int]:
        return self.lab.address(i), AMQP_PORT

    def cluster(self, via: int | None = None):
        """The cluster as seen through node ``via`` (default: the first that answers)."""
        from mirrorq.admin.remote import RemoteCluster

        last: Exception | None = None
        for i in [via] if via else [j for j in range(1, len(self.names) + 1) if j in self.procs]:
            try:
                return RemoteCluster(f"{self.lab.address(i)}:{ADMIN_PORT}", str(self.secret))
            except ClusterError as e:
                last = e
        raise ClusterError(f"no node of lab {self.lab.name} answers: {last}")

    def views(self) -> dict[str, dict[str, str] | None]:
        """Every running node's view (name -> state), None for one that does not answer."""
        from mirrorq.node.client import NodeClient, NodeUnreachable

        out: dict[str, dict[str, str] | None] = {}
        for i in sorted(self.procs):
            try:
                with NodeClient(ADMIN_PORT, self.lab.address(i)) as c:
                    st = c.status(2.0)
                out[self.names[i - 1]] = {n: v["state"] for n, v in st.view.items()}
            except NodeUnreachable:
                out[self.names[i - 1]] = None
        return out

    def wait_all_up(self, timeout: float) -> None:
        """Every running node sees every running node up; raise naming what was seen."""
        seen: dict[str, Any] = {}

        def ok() -> bool:
            seen.clear()
            seen.update(self.views())
            running = {self.names[i - 1] for i in self.procs}
            return all(v is not None and all(v.get(n) == "up" for n in running) for v in seen.values())

        if not poll(ok, timeout, step=0.2):
            raise ClusterError(f"lab nodes did not all see each other within {timeout:.0f}s: {seen}")

    def close(self) -> None:
        """Stop every node (SIGTERM, then kill), tear the lab down."""
        try:
            for i in list(self.procs):
                try:
                    self.stop(i)
                except (NetLabError, subprocess.TimeoutExpired):
                    pass
                pgid = self.admin_pgid(i)
                if pgid is not None and daemon.process_group_alive(pgid):
                    daemon.kill_group(pgid)
        finally:
            self.lab.teardown()

    def __enter__(self) -> LabCluster:
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mirrorq.admin.lab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--data-dir", default=None, help="where the nodes' configs and data go")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="netem delay on each node's link (each end)")
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--loss-pct", type=float, default=0.0)
    ap.add_argument("--management", action="store_true", help="run each node's management server (port 15672)")
    ap.add_argument("--cleanup", action="store_true", help="only delete leftovers of labs whose creator is dead")
    args = ap.parse_args(argv)
    if args.cleanup:
        gone = cleanup_stale()
        print(f"deleted: {', '.join(gone) if gone else 'nothing'}")
        return 0
    if not args.data_dir:
        ap.error("--data-dir is required")

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    lc = LabCluster(args.nodes, args.data_dir, management=args.management)
    try:
        lc.open()
        for i in range(1, args.nodes + 1):
            if args.delay_ms or args.jitter_ms or args.loss_pct:
                lc.lab.set_link(i, args.delay_ms, args.jitter_ms, args.loss_pct)
        lc.start()
        lc.wait_all_up(60)
        print(f"lab {lc.lab.name}: {args.nodes} nodes up; secret {lc.secret}")
        for i, n in enumerate(lc.names, 1):
            print(f"  {n}: namespace {lc.lab.ns(i)}, {lc.lab.address(i)} (admin {ADMIN_PORT}, amqp {AMQP_PORT})")
        print(f"mirrorctl --address {lc.lab.address(1)}:{ADMIN_PORT} --secret-file {lc.secret} cluster_status")
        print("Ctrl-C or SIGTERM stops the nodes and removes the lab", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    except (ClusterError, NetLabError) as e:
        print(f"lab: {e}", file=sys.stderr)
        return 1
    finally:
        lc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
