"""mirrorq.admin.session: registry reads asked again across a Raft leader change
(issue #17: ``list_policies`` failed an idle cluster with "did not answer a
registry read within 5s"), transactions resent only when surely not
committed, and the deadline (``--timeout``) as exit 75."""

from __future__ import annotations

import pytest

import mirrorq.admin.session as cs
from mirrorq.admin.cluster import ClusterError, CommandTimeout
from mirrorq.node.messages import RegistryResult, RegistryRows


class FakeClient:
    """Answers each ask with the next of ``answers`` (None: no answer)."""

    def __init__(self, answers, log):
        self.answers, self.log = answers, log

    def ask(self, msg, timeout):
        self.log.append((type(msg).__name__, timeout))
        return self.answers.pop(0) if self.answers else None

    def close(self):
        self.log.append(("close", None))


def session(answers, timeout=5.0, monkeypatch=None):
    log: list = []
    s = cs.NodeSession.__new__(cs.NodeSession)
    s.node, s.admin_port, s.host, s.timeout = "node1", 1, "127.0.0.1", timeout
    s._manager = s._listener = None
    s.client = FakeClient(answers, log)
    if monkeypatch is not None:  # a fresh client shares the remaining answers
        import mirrorq.node.client as nc

        monkeypatch.setattr(nc, "NodeClient", lambda port, host="127.0.0.1": FakeClient(answers, log))
    return s, log


def test_read_retried_across_a_leader_change_and_a_lost_answer(monkeypatch):
    monkeypatch.setattr(cs, "RETRY_PAUSE", 0.0)
    answers = [
        RegistryRows(False, [], "registry leader changed; retry"),
        None,
        RegistryRows(False, [], "not the registry leader (leader: node2); retry"),
        RegistryRows(True, [{"name": "p"}]),
    ]
    s, log = session(answers, monkeypatch=monkeypatch)
    assert s.rows("policy") == [{"name": "p"}]
    asks = [t for name, t in log if name == "RegistryGet"]
    assert len(asks) == 4 and all(t <= cs.ATTEMPT for t in asks)
    assert ("close", None) in log  # the unanswered ask's client was replaced


def test_read_error_that_is_not_a_retry_fails_at_once():
    s, _ = session([RegistryRows(False, [], "no table 'nope'")])
    with pytest.raises(ClusterError, match="no table 'nope'"):
        s.rows("nope")


def test_read_gives_up_at_the_deadline(monkeypatch):
    monkeypatch.setattr(cs, "RETRY_PAUSE", 0.0)
    clock = iter(range(0, 1000, 2))
    monkeypatch.setattr(cs.time, "monotonic", lambda: float(next(clock)))
    s, log = session([RegistryRows(False, [], "retry")] * 100, timeout=5.0)
    with pytest.raises(CommandTimeout) as e:
        s.rows("policy")
    assert e.value.exit_code == 75 and len([x for x in log if x[0] == "RegistryGet"]) <= 3


def test_txn_resent_only_when_surely_not_committed(monkeypatch):
    monkeypatch.setattr(cs, "RETRY_PAUSE", 0.0)
    s, log = session([RegistryResult(False, "not the registry leader (leader: unknown); retry"), RegistryResult(True)])
    assert s.txn({"ops": []}).ok
    assert [x[0] for x in log] == ["RegistryTxn", "RegistryTxn"]
    s, log = session([RegistryResult(False, "transaction of unknown outcome; retry")])
    assert s.txn({"ops": []}).error == "transaction of unknown outcome; retry"
    s, log = session([None])
    with pytest.raises(CommandTimeout, match="outcome is unknown"):
        s.txn({"ops": []})
    assert [x[0] for x in log] == ["RegistryTxn"]


def test_an_idempotent_txn_is_submitted_again_after_an_unknown_outcome_or_no_answer(monkeypatch):
    """set_policy is one put: a leader change that leaves its outcome unknown
    (or eats the answer) must not fail the command; applying it twice is once."""
    monkeypatch.setattr(cs, "RETRY_PAUSE", 0.0)
    s, log = session(
        [RegistryResult(False, "transaction of unknown outcome; retry"), None, RegistryResult(True)],
        monkeypatch=monkeypatch,
    )
    assert s.txn({"ops": []}, idempotent=True).ok
    assert [x[0] for x in log if x[0] == "RegistryTxn"] == ["RegistryTxn"] * 3


def test_a_remote_cluster_sends_a_command_to_the_addressed_node_first(monkeypatch):
    """``mirrorctl --address NODE2`` with no ``-n``: the session is with node2
    (was: the layout's first running node, which during a cut of node1 was
    the one that could not read the registry); a paused addressed node
    hands over to the next one that is not paused."""
    from mirrorq.admin import session as sm
    from mirrorq.admin.remote import RemoteCluster

    remote = RemoteCluster.__new__(RemoteCluster)
    remote.entry_name = "node2"
    monkeypatch.setattr(RemoteCluster, "node_names", lambda self: ["node1", "node2", "node3"])
    assert remote.session_order() == ["node2", "node1", "node3"]

    class FakeSession:
        def __init__(self, node, port, shell, timeout, host):
            self.node = node

        def close(self):
            pass

    class Config:
        amqp_shell = "watch"

    monkeypatch.setattr(RemoteCluster, "is_running", lambda self, n: True)
    monkeypatch.setattr(RemoteCluster, "pid_info", lambda self, n: {"admin_port": 1})
    monkeypatch.setattr(RemoteCluster, "admin_address", lambda self, n: ("10.0.0.1", 1))
    monkeypatch.setattr(RemoteCluster, "config", lambda self, n: Config())
    monkeypatch.setattr(sm, "NodeSession", FakeSession)
    paused: set[str] = set()
    monkeypatch.setattr(sm, "minority_refusal", lambda s: "paused" if s.node in paused else "")
    assert sm.open_session(remote, None).node == "node2"
    paused.add("node2")
    assert sm.open_session(remote, None).node == "node1"
