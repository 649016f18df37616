"""Spark tests: one SparkSession for the whole session (its JVM takes ~10 s
to start), one 3-node cluster per module; drivers that are killed run as
subprocesses in their own process group (killed by that group's id, and
always reaped)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import conftest
import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def spark():
    from mirrorq.spark.session import session

    s = session("mirrorq-tests", master="local[2,4]")  # up to 4 attempts per task: retries are tested
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def cluster():
    with conftest.running_cluster() as c:
        assert c.ctl("set_policy", "ha-all", "^spark", '{"ha-mode": "all", "ha-sync-mode": "automatic"}') == 0
        yield c


def nodes_of(c) -> str:
    return ",".join(f"127.0.0.1:{c.amqp_base_port + i}" for i in range(c.nodes))


def declare(c, queue: str, node: int = 0) -> None:
    import pika

    conn = pika.BlockingConnection(
        pika.ConnectionParameters("127.0.0.1", c.amqp_base_port + node, connection_attempts=3)
    )
    try:
        conn.channel().queue_declare(queue, durable=True)
    finally:
        conn.close()


def wait_mirrored(c, capsys, queue: str, n: int) -> None:
    def pred():
        rows = c.ctl_json(capsys, "list_queues", "name", "synchronised_slave_pids", "messages")
        row = next((r for r in rows or [] if r["name"] == queue), None)
        ok = row is not None and len(row["synchronised_slave_pids"] or []) == c.nodes - 1 and row["messages"] == n
        return ok, row

    conftest.wait_for(pred, 60, f"queue {queue} with {n} messages on {c.nodes} synchronised replicas")


def publish(c, queue: str, n: int, size: int = 100, node: int = 0, prefix: str = "m") -> list[bytes]:
    """n persistent messages, pipelined with confirms; returns their bodies."""
    from pamqp import commands as C

    from mirrorq.amqp.client import BlockingClient

    bodies = [(f"{prefix}{i:07d}-".encode() + b"x" * size)[: max(size, 9)] for i in range(n)]
    with BlockingClient("127.0.0.1", c.amqp_base_port + node) as cl:
        for i in range(0, n, 5000):
            chunk = [(b, C.Basic.Properties(delivery_mode=2, message_id=b[:8].decode())) for b in bodies[i : i + 5000]]
            cl.publish_confirmed("", queue, chunk, time.monotonic() + 120)
    return bodies


def queue_info(c, capsys, queue: str) -> dict:
    rows = c.ctl_json(capsys, "list_queues", "name", "pid", "messages", "consumers")
    return next(r for r in rows if r["name"] == queue)


@contextlib.contextmanager
def driver(*args: str, log: Path):
    """``python -m mirrorq.spark.pipe ARGS`` in its own process group; on
    exit the whole group is killed (if still there) and reaped."""
    env = dict(
        os.environ,
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SPARK_LOCAL_IP="127.0.0.1",
        PYTHONPATH=str(REPO),
    )
    with open(log, "ab") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", "mirrorq.spark.pipe", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield p
    finally:
        kill_group(p)


@contextlib.contextmanager
def standalone(work: Path, workers: int = 2):
    """A Spark standalone cluster on loopback: a master and ``workers``
    workers (1 core, 1 GiB each), every one in its own process group
    (its executors and their Python workers with it), all killed by group
    and reaped on exit.  Yields ``(master URL, conf for an application)``:
    the driver and block managers on ports of the block."""
    import pyspark

    from mirrorq.admin.cluster import free_port_block

    spark_class = str(Path(pyspark.__file__).parent / "bin" / "spark-class")
    work.mkdir(parents=True, exist_ok=True)
    base = free_port_block(40, 20000, 32000)  # master, driver, workers; block managers from base + 20
    env = dict(
        os.environ,
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_WORKER_DIR=str(work / "work"),
        SPARK_LOG_DIR=str(work / "logs"),
        PYSPARK_PYTHON=sys.executable,
    )
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []

    def start(name: str, *args: str) -> None:
        log = work / f"{name}.log"
        logs.append(log)
        with open(log, "ab") as out:
            procs.append(
                subprocess.Popen(
                    [spark_class, *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    url = f"spark://127.0.0.1:{base}"
    try:
        start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(base),
              "--webui-port", str(base + 1))  # fmt: skip
        for i in range(workers):
            p = base + 4 + 2 * i
            start(f"worker{i}", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--port", str(p),
                  "--webui-port", str(p + 1), "--cores", "1", "--memory", "1g", url)  # fmt: skip

        def registered():
            n = sum("Successfully registered with master" in lg.read_text(errors="replace") for lg in logs[1:])
            return n == workers, n

        conftest.wait_for(registered, 120, f"{workers} workers registered", lambda: logs[0].read_text()[-3000:])
        conf = {
            "spark.driver.port": str(base + 2),
            "spark.blockManager.port": str(base + 20),
            "spark.port.maxRetries": "16",
            "spark.executor.memory": "768m",
            "spark.cores.max": str(workers),
        }
        yield url, conf
    finally:
        for p in procs:
            kill_group(p)


def kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the driver and its JVM and Python workers
    except ProcessLookupError:
        pass
    p.wait(timeout=30)


def committed_batches(checkpoint: Path) -> int:
    d = checkpoint / "commits"
    return len([n for n in os.listdir(d) if n.isdigit()]) if d.is_dir() else 0


def wait_exit(p: subprocess.Popen, timeout: float, log: Path) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"driver still running after {timeout}s; its log:\n{log.read_text()[-4000:]}") from None
