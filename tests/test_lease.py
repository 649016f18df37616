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
