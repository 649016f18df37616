"""mirrorq-server on loopback: one node in the foreground from its config
file; SIGTERM stops it cleanly (exit 0, every process it started gone,
node.pid removed); a node whose processes are killed under it makes it
exit 1 (for systemd's Restart=on-failure)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port_block

from mirrorq.admin.cluster import poll
from mirrorq.node import daemon, wire
from mirrorq.node.client import NodeClient
from mirrorq.node.config import NodeConfig

pytestmark = pytest.mark.cluster


def _server(tmp: Path) -> tuple[subprocess.Popen, NodeConfig, Path]:
    base = free_port_block(3)
    secret = wire.create_secret(tmp)
    cfg = NodeConfig(
        name="solo",
        host="127.0.0.1",
        admin_port=base,
        amqp_port=base + 1,
        management_port=base + 2,
        data_dir=str(tmp / "solo"),
        secret_file=str(secret),
        queue_hosts=1,
    )
    path = tmp / "solo.yaml"
    cfg.dump(path)
    out = tmp / "server.out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mirrorq.server", "--config", str(path)],
        stdout=open(out, "wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    return proc, cfg, out


def _wait_running(proc, out: Path) -> int:
    assert poll(lambda: b" running on " in out.read_bytes() or proc.poll() is not None, 60), out.read_text()
    assert proc.poll() is None, out.read_text()
    return int((daemon.read_pid_file(str(Path(out).parent / "solo")) or {})["pgid"])


def _cleanup(proc, tmp: Path) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)
    rec = daemon.read_pid_file(str(tmp / "solo"))
    if rec:
        daemon.kill_group(int(rec["pgid"]))


def test_sigterm_stops_the_node_and_everything_it_started(data_root):
    proc, cfg, out = _server(data_root)
    try:
        pgid = _wait_running(proc, out)
        wire.use_secret_file(cfg.secret_file)
        with NodeClient(cfg.admin_port, cfg.host) as c:
            assert c.status(5).name == "solo"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, out.read_text()
        assert not daemon.process_group_alive(pgid)
        assert not daemon.process_group_alive(proc.pid)
        assert daemon.read_pid_file(cfg.data_dir) is None
        assert "stopping node solo" in out.read_text()
    finally:
        _cleanup(proc, data_root)


def test_the_server_exits_1_when_its_node_is_killed(data_root):
    proc, cfg, out = _server(data_root)
    try:
        pgid = _wait_running(proc, out)
        daemon.kill_group(pgid)
        assert proc.wait(30) == 1
        assert "died" in out.read_text()
        assert not daemon.process_group_alive(proc.pid)
    finally:
        _cleanup(proc, data_root)
