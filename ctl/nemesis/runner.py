"""One nemesis run against a real local cluster: the thin, impure shell around
:mod:`~ctl.nemesis.schedule` (what to do), :mod:`~ctl.nemesis.net`
(partitions), :mod:`~ctl.nemesis.clients` (pika, history) and
:mod:`~ctl.nemesis.checker` (the verdict).

A run:

1. opens the cgroups and iptables chains (when partitions are scheduled),
   creates a cluster in ``data_dir`` whose nodes start inside their cgroups,
   starts it, sets a policy mirroring the queue on every node
   (``ha-mode all``, ``ha-sync-mode automatic``);
2. starts ``publishers`` publishers and ``consumers`` consumers on different
   nodes, waits for the first confirm and the first delivery;
3. runs each step: resolves its target (master / mirror / consumer's node /
   publisher's node / any) from the live cluster, applies the fault, holds
   it, ends it (restart, SIGCONT, heal) and records how long the queue took
   to have its replica count back (within the step's quiet time);
4. heals everything, waits until the replica count is restored (at most
   ``restore_bound`` seconds), publishes for ``tail`` more seconds, stops the
   publishers, drains (until every confirmed message was consumed, or no
   delivery came for ``drain_quiet`` seconds, at most ``drain_bound``), reads
   the queue's final depth, stops the consumers;
5. stops every node and removes every rule and cgroup -- in ``finally``, so
   also when anything above fails -- and checks the history.

The history goes to ``<data_dir>/history.jsonl`` (format:
:mod:`ctl.nemesis.history`).  The returned :class:`RunResult` holds the
checker's report, the replica restore times and the faults applied.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ctl.nemesis import checker
from ctl.nemesis.clients import Consumer, Publisher
from ctl.nemesis.history import HistoryWriter
from ctl.nemesis.net import NetNemesis
from ctl.nemesis.schedule import FLAP_PERIOD, Step
from mirrorq.admin.cluster import Cluster, ClusterError, free_port_block
from mirrorq.node import daemon

#: seconds between two rounds of control-plane operations on the majority
CONTROL_EVERY = 5.0
#: a control-plane operation's own deadline (the checker's bound is RunConfig.control_bound)
CONTROL_TIMEOUT = 10.0
#: a node whose fault began or ended this recently is not asked (it may still be rejoining)
CONTROL_SETTLE = 15.0


@dataclass
class RunConfig:
    data_dir: Path
    steps: list[Step]
    seed: int = 0
    nodes: int = 3
    queue: str = "nemesis.q"
    publishers: int = 1
    consumers: int = 1
    prefetch: int = 50
    rate: float = 0.0
    bound: float = 30.0  # every publish and declare answered within this
    restore_bound: float = 60.0  # replica counts back after the final heal within this
    control_bound: float = 5.0  # every control-plane operation on the majority answered within this
    tail: float = 5.0
    drain_quiet: float = 10.0
    drain_bound: float = 60.0
    heartbeat_interval: float = 0.2
    heartbeat_timeout: float = 1.5


@dataclass
class RunResult:
    report: checker.Report
    restore_times: list = field(default_factory=list)  # (step, seconds or None)
    final_restore: float | None = None
    final_state: dict = field(default_factory=dict)
    faults: list = field(default_factory=list)
    history_path: str = ""
    errors: list = field(default_factory=list)
    step_down: list = field(default_factory=list)  # seconds from each cut to the cut node's "minority"
    heal: list = field(default_factory=list)  # seconds from each heal to the node's "majority"

    @property
    def valid(self) -> bool:
        return self.report.valid and self.final_restore is not None

    def problems(self) -> list[str]:
        out = self.report.problems()
        if self.final_restore is None:
            out.append(f"replica counts not restored after the final heal: {self.final_state}")
        return out


class Runner:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.names = [f"node{i + 1}" for i in range(cfg.nodes)]
        self.net: NetNemesis | None = None
        Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)
        self.cluster = Cluster(Path(cfg.data_dir))
        self.h = HistoryWriter(str(Path(cfg.data_dir) / "history.jsonl"))
        self.down: set[str] = set()  # killed / stopped
        self.paused: set[str] = set()
        self.cut: set[str] = set()  # partitioned away
        self.clients: list = []
        self.ports: dict[str, int] = {}
        self._flap: tuple | None = None
        self._control_stop = threading.Event()
        self.faulted: dict[str, float] = {}  # node -> monotonic time its last fault began or ended

    # ---- cluster --------------------------------------------------------------
    def _ctl(self, *argv: str):
        from ctl.mirrorctl import main

        out, err = io.StringIO(), io.StringIO()
        args = ["--data-dir", str(self.cfg.data_dir), "--formatter", "json"]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([*args, *argv])
        if rc != 0:
            raise ClusterError(f"mirrorctl {' '.join(argv)}: {err.getvalue().strip()}")
        return json.loads(out.getvalue()) if out.getvalue().strip() else None

    def healthy(self) -> list[str]:
        return [n for n in self.names if n not in self.down | self.paused | self.cut]

    def queue_row(self) -> dict | None:
        for n in self.healthy():
            try:
                rows = self._list_queues(n)
            except Exception:  # noqa: BLE001 -- try the next node
                continue
            for r in rows or []:
                if r["name"] == self.cfg.queue:
                    return r
            return None
        return None

    def _list_queues(self, node: str):
        from ctl.mirrorctl import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(
                [
                    "--data-dir",
                    str(self.cfg.data_dir),
                    "--formatter",
                    "json",
                    "list_queues",
                    "-n",
                    node,
                    "name",
                    "pid",
                    "slave_pids",
                    "synchronised_slave_pids",
                    "messages",
                    "messages_ready",
                    "messages_unacknowledged",
                    "consumers",
                    "state",
                ]
            )
        if rc != 0:
            raise ClusterError(err.getvalue().strip())
        return json.loads(out.getvalue()) if out.getvalue().strip() else []

    def restored(self) -> tuple[bool, dict | None]:
        r = self.queue_row()
        ok = bool(
            r
            and r.get("pid") is not None
            and not str(r.get("state") or "down").startswith("down")
            and len(set(r.get("slave_pids") or [])) == self.cfg.nodes - 1
            and len(set(r.get("synchronised_slave_pids") or [])) == self.cfg.nodes - 1
        )
        return ok, r

    def wait_restored(self, bound: float) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < bound:
            ok, _ = self.restored()
            if ok:
                return round(time.monotonic() - t0, 2)
            time.sleep(0.5)  # polling interval of a condition with a deadline
        return None

    def start_node(self, n: str) -> bool:
        for attempt in range(3):
            try:
                self.cluster.start_node(n)
                self.h.record("info", "start", n, process="nemesis")
                self.down.discard(n)
                return True
            except ClusterError as e:
                self.h.record("info", "start", n, process="nemesis", error=str(e), attempt=attempt)
                self.cluster.kill_node(n)
                self.cluster._forget_pid(n)
        return False

    def _amqp_port(self, n: str) -> int:
        info = self.cluster.pid_info(n)
        assert info is not None, f"node {n} has no pid file"  # started, and seen up by every node
        return int(info["amqp_port"])

    def pgid(self, n: str) -> int | None:
        info = self.cluster.pid_info(n)
        return int(info["pgid"]) if info else None

    # ---- faults ---------------------------------------------------------------
    def resolve(self, target: str) -> str | None:
        r = self.queue_row() or {}
        master = r.get("pid")
        healthy = self.healthy()
        if target == "master":
            cand = [master] if master in healthy else []
        elif target == "mirror":
            cand = sorted(set(r.get("slave_pids") or []) & set(healthy))
        elif target in ("consumer", "publisher"):
            kind = Consumer if target == "consumer" else Publisher
            cand = sorted({c.node for c in self.clients if isinstance(c, kind) and c.node in healthy})
        else:
            cand = healthy
        return self.rng.choice(cand) if cand else (self.rng.choice(healthy) if healthy else None)

    def apply(self, step: Step, node: str) -> None:
        self.faulted[node] = time.monotonic()
        rec = lambda f, **kw: self.h.record("info", f, node, process="nemesis", target=step.target, **kw)  # noqa: E731
        if step.fault == "kill":
            rec("kill")
            self.cluster.kill_node(node)
            self.down.add(node)
        elif step.fault == "stop":
            rec("stop")
            self.cluster.stop_node(node)
            self.down.add(node)
        elif step.fault == "restart":
            rec("stop")
            self.cluster.stop_node(node)
            self.down.add(node)
        elif step.fault == "pause":
            pg = self.pgid(node)
            rec("pause", pgid=pg)
            if pg:
                os.killpg(pg, signal.SIGSTOP)
                self.paused.add(node)
        elif step.fault.startswith("partition-") or step.fault == "flap":
            mode = "drop" if step.fault in ("flap", "partition-oneway") else step.fault.split("-", 1)[1]
            one_way = step.fault == "partition-oneway"
            groups = [[node], [n for n in self.names if n != node]]
            assert self.net is not None
            self.net.partition(groups, mode, one_way=one_way)
            self.cut.add(node)
            self.h.record(
                "info",
                "partition",
                groups,
                process="nemesis",
                mode=mode,
                target=step.target,
                node=node,
                one_way=one_way,
                flap=step.fault == "flap",
            )
            if step.fault == "flap":
                stop = threading.Event()
                t = threading.Thread(target=self._flapping, args=(groups, stop), daemon=True)
                self._flap = (stop, t)
                t.start()
        else:
            raise ValueError(step.fault)

    def _flapping(self, groups: list, stop: threading.Event) -> None:
        """Heal and cut again every FLAP_PERIOD seconds until ``stop``."""
        cut = True
        while not stop.wait(FLAP_PERIOD):
            assert self.net is not None
            if cut:
                self.net.heal()
            else:
                self.net.partition(groups, "drop")
            cut = not cut

    def end(self, step: Step, node: str) -> None:
        self.faulted[node] = time.monotonic()
        if self._flap is not None:
            stop, t = self._flap
            stop.set()
            t.join()  # no cut of its may land after the heal below
            self._flap = None
        if node in self.paused:
            pg = self.pgid(node)
            if pg:
                try:
                    os.killpg(pg, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self.paused.discard(node)
            self.h.record("info", "resume", node, process="nemesis")
        if node in self.cut:
            assert self.net is not None
            self.net.heal()
            self.cut.discard(node)
            self.h.record("info", "heal", node, process="nemesis")
        if node in self.down:
            self.start_node(node)

    def heal_all(self) -> None:
        for n in list(self.paused):
            pg = self.pgid(n)
            if pg:
                try:
                    os.killpg(pg, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self.paused.discard(n)
        if self.net is not None:
            self.net.heal()
        self.cut.clear()
        for n in self.names:
            if not self.cluster.is_running(n):
                self.start_node(n)
        self.h.record("info", "heal", "all", process="nemesis")

    # ---- the majority's control plane ---------------------------------------------
    def _control_loop(self) -> None:
        """Every CONTROL_EVERY seconds, on a node of the majority (neither cut,
        paused nor down): a queue declare and delete (AMQP), a policy change
        and ``list_queues`` (mirrorctl in a process of its own, as an
        operator runs it), each recorded as a ``control`` op with its latency."""
        import subprocess
        import sys

        import pika

        i = 0
        while not self._control_stop.wait(CONTROL_EVERY):
            # the majority: neither cut, paused nor down, and not just back from a fault (a node
            # healed a moment ago may still be paused until it hears a majority)
            settled = time.monotonic() - CONTROL_SETTLE
            healthy = [n for n in self.healthy() if self.faulted.get(n, 0.0) < settled]
            if not healthy:
                continue
            node = healthy[i % len(healthy)]
            i += 1
            t = time.monotonic()
            try:
                conn = pika.BlockingConnection(
                    pika.ConnectionParameters(
                        "127.0.0.1",
                        self.ports[node],
                        connection_attempts=1,
                        socket_timeout=CONTROL_TIMEOUT,
                        blocked_connection_timeout=CONTROL_TIMEOUT,
                    )
                )
                try:
                    ch = conn.channel()
                    ch.queue_declare(f"control.{i}")
                    ch.queue_delete(f"control.{i}")
                finally:
                    conn.close()
                self.h.record(
                    "ok",
                    "control",
                    "declare",
                    process="control",
                    node=node,
                    latency=round(time.monotonic() - t, 3),
                    majority=self._majority(node, t),
                )
            except Exception as e:  # noqa: BLE001 - recorded; the checker fails the run
                if self._majority(node, t):
                    self.h.record(
                        "fail",
                        "control",
                        "declare",
                        process="control",
                        node=node,
                        latency=round(time.monotonic() - t, 3),
                        error=repr(e)[:200],
                    )
            for op, argv in (
                (
                    "set_policy",
                    [
                        "set_policy",
                        "-n",
                        node,
                        "control",
                        "^control\\.",
                        json.dumps({"dead-letter-routing-key": f"rk{i}"}),
                    ],
                ),
                ("list_queues", ["list_queues", "-n", node, "name"]),
            ):
                t = time.monotonic()
                try:
                    p = subprocess.run(
                        [
                            sys.executable,
                            "-m",
                            "ctl.mirrorctl",
                            "--data-dir",
                            str(self.cfg.data_dir),
                            "--timeout",
                            str(CONTROL_TIMEOUT),
                            *argv,
                        ],
                        capture_output=True,
                        text=True,
                        timeout=3 * CONTROL_TIMEOUT,
                        cwd=str(Path(__file__).resolve().parents[2]),
                    )
                    ok, err = p.returncode == 0, p.stderr.strip()[-200:]
                except subprocess.TimeoutExpired:
                    ok, err = False, "timed out"
                majority = self._majority(node, t)
                if ok or majority:
                    self.h.record(
                        "ok" if ok else "fail",
                        "control",
                        op,
                        process="control",
                        node=node,
                        latency=round(time.monotonic() - t, 3),
                        error=None if ok else err,
                        majority=majority,
                    )

    def _majority(self, node: str, since: float) -> bool:
        """``node`` was of the settled majority all through an operation begun
        at ``since`` (one it failed while a fault began on it is no failure
        of the majority)."""
        return node in self.healthy() and self.faulted.get(node, 0.0) < since - CONTROL_SETTLE

    # ---- the run --------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        needs_net = any(s.fault.startswith("partition-") or s.fault == "flap" for s in cfg.steps)
        if needs_net:
            self.net = NetNemesis(self.names).open()
            self.cluster.launch_prefix = lambda name: [
                "sh",
                "-c",
                'echo $$ > "$0" && exec "$@"',
                self.net.procs_file(name),
            ]
        base = free_port_block(2 * cfg.nodes + 1)
        self.cluster.create(cfg.nodes, base, base + cfg.nodes + 1, cfg.heartbeat_interval, cfg.heartbeat_timeout)
        for n in self.names:
            if not self.start_node(n):
                raise ClusterError(f"node {n} did not start")
        self.cluster.wait_all_up(self.names, 60)
        self.ports = {n: self._amqp_port(n) for n in self.names}
        self._ctl(
            "set_policy",
            "--apply-to",
            "queues",
            "nemesis-all",
            "^" + cfg.queue.replace(".", "\\.") + "$",
            json.dumps({"ha-mode": "all", "ha-sync-mode": "automatic"}),
        )

    def run(self) -> RunResult:
        cfg = self.cfg
        result = RunResult(report=checker.Report(), history_path=self.h.path or "")
        try:
            self.setup()
            for i in range(cfg.consumers):
                self.clients.append(
                    Consumer(
                        f"c{i + 1}", self.ports, cfg.queue, self.h, op_timeout=cfg.bound, first=i, prefetch=cfg.prefetch
                    )
                )
            for i in range(cfg.publishers):
                self.clients.append(
                    Publisher(
                        f"p{i + 1}",
                        self.ports,
                        cfg.queue,
                        self.h,
                        op_timeout=cfg.bound,
                        first=cfg.consumers + i,
                        rate=cfg.rate,
                    )
                )
            for c in self.clients:
                c.start()
            control = threading.Thread(target=self._control_loop, name="nemesis-control", daemon=True)
            control.start()
            deadline = time.monotonic() + 60
            while not {"publish", "consume"} <= {op["f"] for op in list(self.h.ops) if op["type"] == "ok"}:
                if time.monotonic() > deadline:
                    raise ClusterError("no publish was confirmed and consumed within 60s of the start")
                time.sleep(0.1)  # polling interval of a condition with a deadline
            for k, step in enumerate(cfg.steps):
                node = self.resolve(step.target)
                if node is None:
                    result.errors.append(f"step {k} {step}: no target")
                    continue
                self.apply(step, node)
                result.faults.append((step.fault, step.target, node))
                threading.Event().wait(step.hold)  # the fault's duration (a schedule, not a condition)
                self.end(step, node)
                t = self.wait_restored(step.quiet) if step.quiet > 0 else None
                result.restore_times.append((f"{step.fault}:{step.target}:{node}", t))
                self.h.record("info", "replicas-restored", t, process="nemesis", step=k)
            self._control_stop.set()
            control.join()
            self.heal_all()
            result.final_restore = self.wait_restored(cfg.restore_bound)
            self.h.record("info", "replicas-restored", result.final_restore, process="nemesis", step="final")
            threading.Event().wait(cfg.tail)  # publish a little longer on the healed cluster
            for c in self.clients:
                if isinstance(c, Publisher):
                    c.stop()
            for c in self.clients:
                if isinstance(c, Publisher):
                    c.join(cfg.bound + 10)
            self._drain()
            _, row = self.restored()
            result.final_state = row or {}
            for c in self.clients:
                c.stop()
            for c in self.clients:
                c.join(cfg.bound + 10)
        finally:
            self._control_stop.set()
            for c in self.clients:
                c.stop()
            try:
                if self.paused:
                    self.heal_all()
            finally:
                try:
                    self.cluster.stop_all()
                finally:
                    if self.net is not None:
                        self.net.close()
                    self.h.close()
        fs = result.final_state
        depth = None
        if fs and fs.get("messages") is not None:
            depth = int(fs.get("messages") or 0)
        result.report = checker.check(self.h.ops, bound=cfg.bound, final_depth=depth, control_bound=cfg.control_bound)
        logs = self.node_logs()
        stopped: dict[str, list[float]] = {}
        for op in self.h.ops:
            if op.get("process") == "nemesis" and op.get("f") in ("kill", "stop", "pause"):
                stopped.setdefault(op["value"], []).append(op["time"])  # record() always writes a value
        result.report.two_masters = checker.mastership_overlaps(logs, cfg.queue, stopped)
        result.step_down, result.heal = partition_times(self.h.ops, logs)
        result.errors += [f"{c.cid}: {e}" for c in self.clients for e in c.errors[-3:]]
        return result

    def node_logs(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for n in self.names:
            events = out[n] = []
            try:
                with open(Path(self.cfg.data_dir) / n / "node.log") as f:
                    for line in f:
                        try:
                            events.append(json.loads(line))
                        except ValueError:
                            pass
            except OSError:
                pass
        return out

    def _drain(self) -> None:
        cfg = self.cfg
        confirmed = {op["value"] for op in list(self.h.ops) if op["f"] == "publish" and op["type"] == "ok"}
        t0 = time.monotonic()
        consumers = [c for c in self.clients if isinstance(c, Consumer)]
        while time.monotonic() - t0 < cfg.drain_bound:
            consumed = {op["value"] for op in list(self.h.ops) if op["f"] == "consume"}
            if confirmed <= consumed:
                return
            last = max(c.last_delivery for c in consumers) if consumers else t0
            if time.monotonic() - max(last, t0) > cfg.drain_quiet:
                return
            time.sleep(0.2)  # polling interval of a condition with a deadline


def partition_times(ops: list[dict], logs: dict[str, list[dict]]) -> tuple[list, list]:
    """For every cut of a node (one-way cuts and flaps included): seconds from
    the cut to the node's first ``minority`` line after it (None if it never
    paused), and from the heal to the ``majority`` line that ended its last
    pause of the cut (0 when that line came before the heal was recorded:
    the heal takes effect before the nemesis writes it down; None if it
    never paused or never came back)."""
    step_down, heal = [], []
    cut_at = None
    for op in ops:
        if op.get("process") != "nemesis":
            continue
        if op.get("f") == "partition":
            cut_at = (op.get("node"), op["time"])
        elif op.get("f") == "heal" and cut_at is not None:
            node, t0 = cut_at
            events = logs.get(node, []) if node is not None else []
            paused = [e["ts"] for e in events if e.get("event") == "minority" and t0 <= e["ts"] <= op["time"]]
            step_down.append(round(paused[0] - t0, 2) if paused else None)
            back = [e["ts"] for e in events if e.get("event") == "majority" and paused and e["ts"] >= paused[-1]]
            heal.append(round(max(0.0, back[0] - op["time"]), 2) if back else None)
            cut_at = None
    return step_down, heal


def alive_leftovers(data_dir: Path) -> list[int]:
    """Process groups of the run's nodes still alive (must be none after a run)."""
    out = []
    for d in Path(data_dir).glob("*/node.pid"):
        info = daemon.read_pid_file(str(d.parent))
        if info and daemon.process_group_alive(int(info["pgid"])):
            out.append(int(info["pgid"]))
    return out


def history_excerpt(result: RunResult, limit: int = 30) -> list[dict]:
    """The history records behind the violations (ids lost, stuck, unexpected,
    unanswered) plus every nemesis operation, in order: what a failing test prints."""
    from ctl.nemesis.history import read

    r = result.report
    ids = set(r.lost[:5]) | set(r.not_consumed[:5]) | set(r.unexpected[:5]) | set(r.failed_delivered[:5])
    ids |= {u["value"] for u in r.unanswered[:5]}
    try:
        ops = read(result.history_path)
    except OSError:
        return []
    nem = [op for op in ops if op.get("process") == "nemesis"]
    about = [
        op
        for op in ops
        if isinstance(op.get("value"), str) and op.get("value") in ids and op.get("process") != "nemesis"
    ]
    slow = [op for op in ops if op.get("error") == "timeout"]
    return nem + about[:limit] + slow[:limit]
