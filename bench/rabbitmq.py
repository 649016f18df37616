"""A throwaway local RabbitMQ cluster for the benchmarks: the yardstick.

    with RabbitMQCluster(nodes=3) as rmq:
        rmq.set_policy("ha", "^bench$", {"ha-mode": "all"})
        port = rmq.amqp_port(0)          # pika.ConnectionParameters("127.0.0.1", port)
        rmq.ctl("list_queues", "name", "slave_pids", node=0)

    .venv/bin/python bench/rabbitmq.py [--nodes 3]     # self-check: start, cluster, publish, stop

What it guarantees:

* Nothing outside its temp dir and its own ports is touched.  Every node is
  ``rabbitN@localhost`` bound to 127.0.0.1 only (AMQP port, Erlang
  distribution port), ``HOME`` (the shared erlang cookie), mnesia, logs,
  the config file, the enabled-plugins file (empty: no management plugin)
  and the env file all live in the temp dir.  The system's rabbitmq service
  is never started and ``/etc/rabbitmq`` is not read (``RABBITMQ_CONF_ENV_FILE``
  points into the temp dir).
* It runs its own ``epmd`` on its own port (``ERL_EPMD_PORT``, never 4369,
  bound to 127.0.0.1), started in the foreground in its own process group,
  so the nodes and ``rabbitmqctl`` register there and the machine's epmd
  (if any) is never used, asked or killed.  CLI tools get their own
  distribution port range (``RABBITMQ_CTL_DIST_PORT_MIN``/``MAX``).
* Every process it starts (each node's ``erl``, its epmd) runs in its own
  session; on exit -- normal, exception, KeyboardInterrupt -- each group is
  sent SIGTERM, then SIGKILL after a short grace, by the recorded PID; the
  epmd is asked to ``-kill`` on its own port first and killed by PID
  anyway.  Nothing is killed by name.
* Start is quick: the nodes boot in parallel, readiness is
  ``rabbitmqctl await_startup`` (no sleeps), and the cluster is formed with
  ``stop_app`` / ``join_cluster rabbit1@localhost`` / ``start_app``.

What it assumes: Debian's rabbitmq-server 3.10 at ``/usr/lib/rabbitmq``
(``bench/install_rabbitmq.sh``), Erlang's ``erl``/``epmd`` on PATH,
``localhost`` resolving to loopback, and that we may run the node as the
current user (root included: the Debian wrapper's ``su rabbitmq`` is
bypassed by calling ``/usr/lib/rabbitmq/bin/*`` directly).

How it fails: a node that does not come up within ``start_timeout``, a
failing ``rabbitmqctl`` and an unusable port raise ``RabbitMQError`` naming
the node and quoting the command's output and the tail of the node's log;
the cluster is stopped before the exception leaves ``__enter__``.  The
temp dir is kept on a failure (its path is in the message) and removed
otherwise unless ``keep=True``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RABBITMQ_BIN = Path(os.environ.get("MIRRORQ_RABBITMQ_BIN", "/usr/lib/rabbitmq/bin"))


class RabbitMQError(RuntimeError):
    pass


def available() -> str | None:
    """None if RabbitMQ can run here, else why not (for a bench to skip with a clear message)."""
    for tool in ("rabbitmq-server", "rabbitmqctl"):
        if not (RABBITMQ_BIN / tool).exists():
            return f"{RABBITMQ_BIN / tool} is missing: run bench/install_rabbitmq.sh"
    for tool in ("erl", "epmd"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH (Erlang is needed by RabbitMQ: run bench/install_rabbitmq.sh)"
    return None


def _port_free(port: int) -> bool:
    """Nobody listens on 127.0.0.1:port (a TIME_WAIT leftover does not count: Erlang binds with SO_REUSEADDR)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port_block(n: int, lo: int = 10000, hi: int = 32000) -> int:
    """The first port of ``n`` consecutive ports free on 127.0.0.1 (random start, not 4369/5672/25672;
    below 32768, where the kernel's ephemeral range starts)."""
    reserved = {4369, 5672, 25672, 15672}
    for _ in range(200):
        base = lo + secrets.randbelow(hi - lo - n)
        ports = range(base, base + n)
        if reserved.isdisjoint(ports) and all(_port_free(p) for p in ports):
            return base
    raise RabbitMQError(f"no block of {n} free ports in {lo}..{hi} on 127.0.0.1")


def _kill_group(proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is not None:
        # The leader is gone; its group may still hold children (erl_child_setup, ...).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _sigterm_to_exit(signum, frame):
    raise SystemExit(128 + signum)


class RabbitMQCluster:
    """``nodes`` RabbitMQ nodes (1..9) on loopback, clustered, with an optional policy.

    ``policy``: ``(name, pattern, definition_dict)`` or a list of them, applied
    once the cluster is formed.  ``config``: extra rabbitmq.conf lines.
    """

    def __init__(
        self,
        nodes: int = 1,
        *,
        policy=None,
        config: str = "",
        start_timeout: float = 90.0,
        stop_grace: float = 5.0,
        keep: bool = False,
        root: str | Path | None = None,
    ):
        if not isinstance(nodes, int) or not 1 <= nodes <= 9:
            raise ValueError(f"nodes must be an int in 1..9, got {nodes!r}")
        why = available()
        if why:
            raise RabbitMQError(why)
        self.n = nodes
        self.policies = [policy] if isinstance(policy, tuple) else list(policy or [])
        self.extra_config = config
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.keep = keep
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="mirrorq-bench-rabbitmq-"))
        self.names = [f"rabbit{i + 1}@localhost" for i in range(nodes)]
        # Ports: [epmd] [amqp x n] [dist x n] [ctl x 12]
        self.base = free_port_block(1 + 2 * nodes + 12)
        self.epmd_port = self.base
        self.amqp_ports = [self.base + 1 + i for i in range(nodes)]
        self.dist_ports = [self.base + 1 + nodes + i for i in range(nodes)]
        self.ctl_ports = (self.base + 1 + 2 * nodes, self.base + 1 + 2 * nodes + 11)
        self.procs: dict[str, subprocess.Popen] = {}
        self.epmd: subprocess.Popen | None = None
        self._failed = False
        self._old_sigterm = None
        self.timings: dict = {}

    # ---- environment -------------------------------------------------------------------------
    def _common_env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update(
            {
                "HOME": str(self.root / "home"),
                "ERL_EPMD_PORT": str(self.epmd_port),
                "ERL_EPMD_ADDRESS": "127.0.0.1",
                "RABBITMQ_CONF_ENV_FILE": str(self.root / "rabbitmq-env.conf"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
                "RABBITMQ_CTL_DIST_PORT_MIN": str(self.ctl_ports[0]),
                "RABBITMQ_CTL_DIST_PORT_MAX": str(self.ctl_ports[1]),
                "LC_ALL": "C.UTF-8",
                "LANG": "C.UTF-8",
            }
        )
        return env

    def node_env(self, i: int) -> dict:
        d = self.root / f"rabbit{i + 1}"
        env = self._common_env()
        env.update(
            {
                "RABBITMQ_NODENAME": self.names[i],
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                "RABBITMQ_NODE_PORT": str(self.amqp_ports[i]),
                "RABBITMQ_DIST_PORT": str(self.dist_ports[i]),
                "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
                "RABBITMQ_LOG_BASE": str(d / "log"),
                "RABBITMQ_CONFIG_FILE": str(self.root / "rabbitmq.conf"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.root / "advanced.config"),
                "RABBITMQ_PID_FILE": str(d / "rabbit.pid"),
                "RABBITMQ_PLUGINS_EXPAND_DIR": str(d / "plugins-expand"),
            }
        )
        return env

    def _prepare(self) -> None:
        home = self.root / "home"
        home.mkdir(parents=True, exist_ok=True)
        cookie = home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(secrets.token_hex(16).upper())
            cookie.chmod(0o400)
        (self.root / "rabbitmq-env.conf").write_text("# intentionally empty: /etc/rabbitmq is not read\n")
        (self.root / "enabled_plugins").write_text("[].\n")
        (self.root / "advanced.config").write_text("[].\n")
        (self.root / "rabbitmq.conf").write_text(
            "loopback_users.guest = true\n"
            "log.console = false\n"
            "log.file.level = info\n"
            "disk_free_limit.absolute = 50MB\n" + self.extra_config + "\n"
        )
        for i in range(self.n):
            for sub in ("mnesia", "log"):
                (self.root / f"rabbit{i + 1}" / sub).mkdir(parents=True, exist_ok=True)

    # ---- processes ---------------------------------------------------------------------------
    def _start_epmd(self) -> None:
        for p in [self.epmd_port, *self.amqp_ports, *self.dist_ports]:
            if not _port_free(p):
                raise RabbitMQError(f"port {p} on 127.0.0.1 was taken after it was chosen (race with another process)")
        out = open(self.root / "epmd.out", "wb")
        self.epmd = subprocess.Popen(
            ["epmd", "-port", str(self.epmd_port), "-address", "127.0.0.1", "-relaxed_command_check"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=self._common_env(),
        )
        out.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.epmd.poll() is not None:
                raise RabbitMQError(
                    f"epmd on port {self.epmd_port} exited with {self.epmd.returncode}: "
                    f"{(self.root / 'epmd.out').read_text()[-500:]}"
                )
            try:
                socket.create_connection(("127.0.0.1", self.epmd_port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.02)  # polling a port with a deadline
        raise RabbitMQError(f"epmd did not listen on 127.0.0.1:{self.epmd_port} within 10 s")

    def start_node(self, i: int) -> None:
        """Start node i's erl (detached from our terminal, its own process group); does not wait."""
        d = self.root / f"rabbit{i + 1}"
        out = open(d / "server.out", "ab")
        self.procs[self.names[i]] = subprocess.Popen(
            [str(RABBITMQ_BIN / "rabbitmq-server")],
            cwd=str(d),
            env=self.node_env(i),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()

    def await_node(self, i: int) -> None:
        name = self.names[i]
        t0 = time.monotonic()
        while True:
            left = self.start_timeout - (time.monotonic() - t0)
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RabbitMQError(f"{name} exited with {proc.returncode} while starting\n{self.log_tail(i)}")
            if left <= 0:
                raise RabbitMQError(f"{name} did not start within {self.start_timeout} s\n{self.log_tail(i)}")
            r = self._run_ctl(["await_startup", "--timeout", str(max(1, int(min(left, 30))))], i, timeout=left + 10)
            if r.returncode == 0:
                return
            # await_startup fails at once while the node is not yet registered with epmd: retry.
            time.sleep(0.2)  # polling the node's boot with a deadline

    def log_tail(self, i: int, n: int = 30) -> str:
        d = self.root / f"rabbit{i + 1}"
        parts = []
        for f in [d / "server.out", *sorted((d / "log").glob("*.log"))]:
            try:
                lines = f.read_text(errors="replace").splitlines()[-n:]
            except OSError:
                continue
            parts.append(f"--- {f} ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def node_log(self, i: int) -> Path:
        return self.root / f"rabbit{i + 1}" / "log" / f"{self.names[i]}.log"

    def __enter__(self) -> RabbitMQCluster:
        # A SIGTERM to the bench (timeout, kill <pid>) would skip __exit__ and leave the nodes
        # running in their own sessions: turn it into SystemExit while the cluster lives.
        self._old_sigterm = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        try:
            self.start()
        except BaseException:
            self._failed = True
            self.stop()
            self._restore_sigterm()
            raise
        return self

    def __exit__(self, et, ev, tb) -> None:
        if et is not None:
            self._failed = True
        try:
            self.stop()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def start(self) -> None:
        t0 = time.monotonic()
        self._prepare()
        self._start_epmd()
        for i in range(self.n):
            self.start_node(i)
        with ThreadPoolExecutor(self.n) as ex:
            list(ex.map(self.await_node, range(self.n)))
        self.timings = {"boot_s": time.monotonic() - t0}
        for i in range(1, self.n):
            self.ctl("stop_app", node=i)
            self.ctl("join_cluster", self.names[0], node=i)
            self.ctl("start_app", node=i)
        if self.n > 1:
            st = self.cluster_status()
            running = set(st.get("running_nodes", []))
            if running != set(self.names):
                raise RabbitMQError(f"cluster not formed: running_nodes={sorted(running)}, want {self.names}")
        self.timings["cluster_s"] = time.monotonic() - t0 - self.timings["boot_s"]
        for pol in self.policies:
            self.set_policy(*pol)

    def stop(self) -> None:
        """Stop every process this cluster started; idempotent; never raises for a process already gone."""
        procs = list(self.procs.values())
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + self.stop_grace
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            _kill_group(p, 0)
        self.procs.clear()
        if self.epmd is not None:
            if self.epmd.poll() is None:
                subprocess.run(
                    ["epmd", "-port", str(self.epmd_port), "-kill"],
                    env=self._common_env(),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=10,
                    check=False,
                )
            _kill_group(self.epmd, 2)
            self.epmd = None
        if not self.keep and not self._failed:
            shutil.rmtree(self.root, ignore_errors=True)

    def kill_node(self, i: int) -> None:
        """SIGKILL node i's whole process group (a crash, not a shutdown)."""
        p = self.procs.pop(self.names[i])
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)

    # ---- rabbitmqctl -------------------------------------------------------------------------
    def _run_ctl(self, argv: list[str], node: int, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.names[node], *argv],
            env=self._common_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            cwd=str(self.root),
        )

    def ctl(self, *argv: str, node: int = 0, timeout: float = 120) -> str:
        """Run ``rabbitmqctl -n <node> argv``; its stdout, or RabbitMQError quoting its output."""
        r = self._run_ctl(list(argv), node, timeout)
        if r.returncode != 0:
            raise RabbitMQError(
                f"rabbitmqctl -n {self.names[node]} {' '.join(argv)} exited with {r.returncode}:\n"
                f"{r.stdout[-2000:]}{r.stderr[-2000:]}"
            )
        return r.stdout

    def ctl_popen(self, *argv: str, node: int = 0) -> subprocess.Popen:
        """rabbitmqctl in the background (e.g. a blocking ``sync_queue`` while another command polls)."""
        return subprocess.Popen(
            [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.names[node], *argv],
            env=self._common_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
            cwd=str(self.root),
        )

    def cluster_status(self) -> dict:
        return json.loads(self.ctl("cluster_status", "--formatter", "json"))

    def set_policy(
        self, name: str, pattern: str, definition: dict, *, apply_to: str = "queues", priority: int = 0
    ) -> None:
        self.ctl(
            "set_policy", "--apply-to", apply_to, "--priority", str(priority), name, pattern, json.dumps(definition)
        )

    def list_queues(self, *items: str, node: int = 0) -> list[dict]:
        out = self.ctl("list_queues", "--quiet", "--formatter", "json", *items, node=node)
        return json.loads(out or "[]")

    def amqp_port(self, i: int = 0) -> int:
        return self.amqp_ports[i]


def _self_check(nodes: int) -> None:
    import pika

    t0 = time.monotonic()
    with RabbitMQCluster(nodes, policy=("ha", "^check$", {"ha-mode": "all"})) as rmq:
        t1 = time.monotonic()
        print(
            f"{nodes} node(s) up and clustered in {t1 - t0:.1f} s {rmq.timings}: {rmq.names}, AMQP {rmq.amqp_ports}, "
            f"epmd {rmq.epmd_port}, dir {rmq.root}"
        )
        conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", rmq.amqp_port(nodes - 1)))
        ch = conn.channel()
        ch.queue_declare("check", durable=True)
        ch.confirm_delivery()
        for _i in range(100):
            ch.basic_publish("", "check", b"x" * 1024, pika.BasicProperties(delivery_mode=2))
        conn.close()
        q = rmq.list_queues("name", "messages", "policy", "slave_pids", "synchronised_slave_pids")
        print("list_queues:", q)
        assert q and q[0]["messages"] == 100, q
        assert len(q[0]["slave_pids"] or []) == nodes - 1, q
        groups = {p.pid for p in rmq.procs.values()} | {rmq.epmd.pid}
        t2 = time.monotonic()
    ps = subprocess.run(["ps", "-eo", "pid=,pgid="], capture_output=True, text=True).stdout.split("\n")
    left = [ln.split()[0] for ln in ps if ln.split() and int(ln.split()[1]) in groups]
    print(
        f"stopped in {time.monotonic() - t2:.1f} s; processes left in its groups: {left or 'none'}; "
        f"ports free again: {all(_port_free(p) for p in rmq.amqp_ports + [rmq.epmd_port])}; "
        f"dir removed: {not rmq.root.exists()}"
    )
    assert not left


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="self-check: start a local RabbitMQ cluster, publish 100, stop it")
    ap.add_argument("--nodes", type=int, default=3)
    _self_check(ap.parse_args().nodes)
