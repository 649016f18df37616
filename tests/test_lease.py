"""The majority lease between the node agent and the node's serving processes."""

from __future__ import annotations

import math

from mirrorq.node.lease import EXPIRED, PAUSED, SERVING, LeaseReader, LeaseWriter


def test_a_reader_sees_every_write_of_the_agent_and_no_file_means_no_limit(tmp_path):
    early = LeaseReader(str(tmp_path))  # before the agent made the file: never paused by it
    assert early.until() == math.inf and not early.paused(1e12)
    w = LeaseWriter(str(tmp_path))
    r = LeaseReader(str(tmp_path))
    assert r.paused(0.0) and early.paused(0.0), "a node is paused until the agent renews the lease"
    w.write(100.0)
    assert not r.paused(99.9) and r.paused(100.0) and not early.paused(99.9)
    assert r.state(99.9) == SERVING and r.state(100.0) == EXPIRED  # the agent did not renew it in time
    w.write(0.0)  # QuorumLost
    assert r.paused(50.0) and r.state(50.0) == PAUSED
    w.write(math.inf)  # pause_minority off
    assert not r.paused(1e12)
    w.close()


def test_a_reader_racing_the_writer_never_sees_a_torn_value(tmp_path):
    """The agent renews the lease many times a second while every serving
    process reads it on every message: a torn read (part old value, part
    new) once read as 0.0, a minority, and closed a majority node's clients."""
    import os

    w = LeaseWriter(str(tmp_path))
    w.write(1e6)
    r_fd, w_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer, as the agent: values in [1e6, 2e6)
        os.close(r_fd)
        k = 0
        while True:
            w.write(1e6 + (k % 999_983) * 1.000001)
            k += 1
            if k % 1000 == 0:
                try:
                    os.write(w_fd, b"")  # the parent closed its end: stop
                except OSError:
                    os._exit(0)
    os.close(w_fd)
    try:
        r = LeaseReader(str(tmp_path))
        bad = [v for v in (r.until() for _ in range(1_000_000)) if not 1e6 <= v < 2e6]
    finally:
        os.close(r_fd)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert not bad, f"{len(bad)} torn reads, e.g. {bad[:3]}"
