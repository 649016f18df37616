"""Bad input to mirrorctl and the node daemon: one clear error line, a
non-zero exit, nothing left running."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from conftest import LocalCluster, free_port_block, processes_under

pytestmark = pytest.mark.cluster


def mirrorctl(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ctl.mirrorctl", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "THESPIAN_BASE_IPADDR": "127.0.0.1"},
    )


def _one_error_line(proc) -> str:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mirrorctl: error: ")
    return lines[0]


def test_unknown_node_name(cluster3):
    for cmd in ("kill_node", "stop_node", "start_node"):
        p = mirrorctl("--data-dir", str(cluster3.data_dir), cmd, "rabbit@nowhere")
        assert "unknown node 'rabbit@nowhere' (known: node1, node2, node3)" in _one_error_line(p)
    p = mirrorctl("--data-dir", str(cluster3.data_dir), "cluster_status", "-n", "nodeX")
    assert "unknown node 'nodeX'" in _one_error_line(p)
    assert all(cluster3.cluster.is_running(n) for n in ("node1", "node2", "node3"))


def test_port_already_in_use(data_root):
    base = free_port_block(3)
    amqp = free_port_block(3, start=base + 4)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", base + 1))  # node2's admin port
    blocker.listen()
    try:
        p = mirrorctl(
            "--data-dir",
            str(data_root),
            "cluster",
            "start",
            "--nodes",
            "3",
            "--base-port",
            str(base),
            "--amqp-base-port",
            str(amqp),
        )
        assert f"admin port {base + 1} is already in use" in _one_error_line(p)
        assert processes_under(data_root) == []  # node1 was started, then stopped again
    finally:
        blocker.close()


def test_malformed_node_yaml(data_root):
    c = LocalCluster(data_root, 2, interval=0.2, timeout=1.5)
    try:
        c.start()
        assert c.ctl("kill_node", "node2") == 0
        cfg = data_root / "node2" / "node.yaml"
        cfg.write_text("name: node2\nadmin_port: [oops\n")
        p = mirrorctl("--data-dir", str(data_root), "start_node", "node2")
        line = _one_error_line(p)
        assert f"config error in {cfg}" in line and "malformed YAML at line" in line
        cfg.write_text("name: node2\nadmin_port: 70000\n")
        p = mirrorctl("--data-dir", str(data_root), "start_node", "node2")
        assert "key 'admin_port': must be a port number" in _one_error_line(p)
        assert not c.cluster.is_running("node2")
    finally:
        c.stop()


def test_unwritable_data_dir(data_root):
    blocker = data_root / "a-file"
    blocker.write_text("not a directory")
    p = mirrorctl(
        "--data-dir",
        str(blocker / "cluster"),
        "cluster",
        "start",
        "--nodes",
        "1",
        "--base-port",
        str(free_port_block(1)),
    )
    assert "is not writable" in _one_error_line(p)
    assert processes_under(data_root) == []


def test_daemon_reports_bad_config_on_stderr(tmp_path):
    cfg = tmp_path / "n.yaml"
    cfg.write_text("name: n1\nheartbeat_interval: 1\nheartbeat_timeout: 1\n")
    p = subprocess.run(
        [sys.executable, "-m", "mirrorq.node.daemon", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 1
    assert p.stderr.strip() == (
        f"mirrorq node: config error in {cfg}: key 'heartbeat_timeout': "
        "must exceed twice heartbeat_interval (1.0), got 1.0"
    )


def test_no_cluster_in_data_dir(tmp_path):
    p = mirrorctl("--data-dir", str(tmp_path / "empty"), "cluster_status")
    assert "no cluster in" in _one_error_line(p)
