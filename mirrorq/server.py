"""Run one node in the foreground: ``python -m mirrorq.server --config node.yaml``
(the ``mirrorq-server`` console script), for systemd and containers.

The node is the one :mod:`mirrorq.node.daemon` starts (same config file,
same checks, same processes: a Thespian admin in a process group of its
own, the actors it forks, the management server); the difference is that
this process stays in the foreground as the node's supervisor instead of
exiting once the node runs:

* a bad config file is one line on stderr naming the file and the key, and
  exit code 78 (EX_CONFIG: ``RestartPreventExitStatus=78`` keeps systemd
  from restarting a node that cannot start); a node that fails to start is
  one line and exit code 1, with nothing left running;
* once the node runs, one line on stdout says where it listens;
* SIGTERM or SIGINT stops the node gracefully (its peers see it leave at
  once, as ``mirrorctl stop_node``), waits at most :data:`STOP_TIMEOUT`
  for its processes, SIGKILLs what is left of every process group it
  started, removes ``node.pid`` and exits 0;
* if the node's process group dies on its own (``kill -9`` of the group,
  the OOM killer), this process kills whatever it started that is left and
  exits 1, so a supervisor restarts it.

Everything the node starts stays this process's descendant (the daemon
makes itself a child subreaper before the actor system starts), so the stop
path reaches every process by the process groups of its descendants, never
by name.  ``--check`` only loads and checks the config (exit 0 or 78).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from mirrorq.node import daemon
from mirrorq.node.config import ConfigError, NodeConfig, load
from mirrorq.stack_room import run_with_room

#: sysexits.h EX_CONFIG: the config file is wrong (do not restart)
EX_CONFIG = 78
#: seconds a graceful stop may take before what is left is SIGKILLed
STOP_TIMEOUT = 10.0
#: seconds between two checks that the node's process group still lives
WATCH_INTERVAL = 0.5
#: seconds the node agent has to acknowledge the leave announcement
LEAVE_TIMEOUT = 3.0


class _Stop(BaseException):
    """SIGTERM or SIGINT arrived."""


def _on_signal(signum: int, frame: Any) -> None:
    raise _Stop(signum)


def _reap() -> None:
    """Collect exited children (this process is a subreaper: orphans of the node land here)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def stop_node(cfg: NodeConfig, asys: Any, pgid: int | None) -> None:
    """Announce the leave, shut the actor system down, wait for the node's
    group (at most :data:`STOP_TIMEOUT`), then SIGKILL every group this
    process started and remove ``node.pid``."""
    from mirrorq.node.messages import AGENT_GLOBAL_NAME, PrepareStop

    if asys is not None and pgid is not None and daemon.process_group_alive(pgid):
        try:
            agent = asys.createActor("mirrorq.node.agent.NodeAgent", globalName=AGENT_GLOBAL_NAME)
            asys.ask(agent, PrepareStop(), LEAVE_TIMEOUT)
            asys.shutdown()
        except Exception as e:  # the node is killed below all the same
            print(f"mirrorq-server: graceful stop of {cfg.name} failed ({e}); killing it", file=sys.stderr)
        deadline = time.monotonic() + STOP_TIMEOUT
        while daemon.process_group_alive(pgid) and time.monotonic() < deadline:
            _reap()
            time.sleep(0.05)  # polling interval of a condition with a deadline
    if pgid is not None:
        daemon.kill_group(pgid)
    daemon.kill_descendants()
    _reap()
    try:
        os.remove(daemon.pid_file(cfg.data_dir))
    except FileNotFoundError:
        pass


def serve(cfg: NodeConfig) -> int:
    """Start the node, supervise it until a signal or its death; the exit code."""
    asys: Any = None
    pgid: int | None = None
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    stdout = os.dup(1)  # the daemon points fd 1 at daemon.out for the admin it forks
    try:
        try:
            info, asys = run_with_room(daemon.launch, cfg)
        finally:
            os.dup2(stdout, 1)
            os.close(stdout)
        pgid = int(info["pgid"])
        ports = f"admin {cfg.admin_port}, amqp {cfg.amqp_port}"
        if cfg.amqps_port:
            ports += f", amqps {cfg.amqps_port}"
        if cfg.management_port:
            ports += f", management {cfg.management_port}"
        print(
            f"mirrorq-server: node {cfg.name} running on {cfg.host} ({ports}); process group {pgid}, "
            f"data dir {cfg.data_dir}",
            flush=True,
        )
        while daemon.process_group_alive(pgid):
            _reap()
            time.sleep(WATCH_INTERVAL)  # a signal ends the wait at once (_Stop)
        print(f"mirrorq-server: node {cfg.name} died (process group {pgid} is gone)", file=sys.stderr, flush=True)
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        stop_node(cfg, None, None)
        return 1
    except _Stop as e:
        for s in old:
            signal.signal(s, signal.SIG_IGN)  # one stop at a time; it ends with a SIGKILL anyway
        if pgid is None:  # the signal came between the start's end and here: read what it recorded
            rec = daemon.read_pid_file(cfg.data_dir) or {}
            pgid = int(rec["pgid"]) if "pgid" in rec else None
        print(f"mirrorq-server: signal {e.args[0]}: stopping node {cfg.name}", file=sys.stderr, flush=True)
        stop_node(cfg, asys, pgid)
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mirrorq-server", description="run one mirrorq node in the foreground")
    ap.add_argument("--config", required=True, help="the node's YAML config (keys: mirrorq/node/config.py)")
    ap.add_argument("--check", action="store_true", help="only check the config file")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load(args.config)
    except ConfigError as e:
        print(f"mirrorq-server: {e}", file=sys.stderr)
        return EX_CONFIG
    if args.check:
        print(f"mirrorq-server: {args.config}: ok (node {cfg.name} on {cfg.host})")
        return 0
    daemon.raise_open_files_limit()
    try:
        return serve(cfg)
    except daemon.StartError as e:
        print(f"mirrorq-server: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
