"""Celery 5 against a 3-node cluster, as a Celery user runs it: the default
worker (mingle and gossip on, its pidbox and event exchanges), ``celery
inspect ping``, and 1000 tasks with the ``rpc://`` result backend (a reply
queue per client, results as messages).  The worker runs in its own process
group and is killed by it, even on failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import conftest
import pytest
from conftest import wait_for

pytest.importorskip("celery")

pytestmark = pytest.mark.cluster

TASKS = textwrap.dedent("""
    import os
    from celery import Celery

    app = Celery("tasks", broker=os.environ["BROKER"], backend="rpc://")
    app.conf.broker_connection_retry_on_startup = True


    @app.task
    def add(x, y):
        return x + y
""")


@pytest.fixture(scope="module")
def cluster():
    with conftest.running_cluster() as c:
        assert c.ctl("set_policy", "--apply-to", "queues", "ha-all", ".*", '{"ha-mode":"all"}') == 0
        yield c


def _celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "tasks", *args]


def test_default_worker_inspect_ping_and_1000_tasks_with_rpc_results(cluster, tmp_path: Path):
    (tmp_path / "tasks.py").write_text(TASKS)
    # the worker's node is not the one the client publishes through
    env = {
        **os.environ,
        "BROKER": f"amqp://guest:guest@127.0.0.1:{cluster.amqp_base_port + 1}//",
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        worker = subprocess.Popen(
            _celery("worker", "--loglevel=INFO", "--concurrency=2", "--hostname=w1@mirrorq"),
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(
            lambda: ("ready." in log.read_text(), log.read_text()[-3000:]),
            60,
            "the worker ready",
            diagnostics=lambda: f"worker exit code: {worker.poll()}",
        )
        ping = subprocess.run(
            _celery("inspect", "ping", "--timeout=10"),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ping.returncode == 0 and "pong" in ping.stdout and "w1@mirrorq" in ping.stdout, ping.stdout + ping.stderr
        client_env = {**env, "BROKER": f"amqp://guest:guest@127.0.0.1:{cluster.amqp_base_port}//"}
        run = subprocess.run(
            [
                sys.executable,
                "-c",
                textwrap.dedent("""
                from tasks import add
                results = [add.delay(i, i) for i in range(1000)]
                got = [r.get(timeout=120) for r in results]
                assert got == [2 * i for i in range(1000)], got[:10]
                print("ok", len(got))
            """),
            ],
            cwd=tmp_path,
            env=client_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0 and "ok 1000" in run.stdout, run.stdout + run.stderr
        text = log.read_text()
        assert "PreconditionFailed" not in text and "inequivalent" not in text, text[-3000:]
        assert "mingle: searching for neighbors" in text, text[-3000:]  # mingle ran (on by default)
    finally:
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        worker.wait(30)
