"""The queue manager's placement decisions (mirrorq.policy.converge).

Unit tests pin each rule; the property tests drive the convergers of every
node against a step model of one queue's ``amqqueue`` record (``World``
below: the record, which node is up, starts that land late or never, stops
that get lost, mirrors that synchronise, promotion when the master's node
dies -- GM's job, modelled) through any sequence of node up/down events and
policy changes.  Checked after every step: only the master's node acts,
never two replicas of the queue on one node, no stop removes the last
synchronised replica.  Checked at the end, with the nodes fixed and mirrors
synchronising between rounds: the convergers go quiet within a bound, and
the record is what the policy asks for.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrorq.policy.converge import (
    BadRecord,
    Converger,
    PushDefinition,
    RecordPolicy,
    StartMirrorOn,
    StopMirrorMember,
    TransferMasterTo,
    argument_definition,
    declare_placement,
    effective_placement_definition,
    node_of,
    replicas_of,
)
from mirrorq.policy.matching import match
from mirrorq.policy.placement import Replica, promotion_candidate
from mirrorq.policy.records import Policy, PolicyValidationError

NODES = ["n1", "n2", "n3", "n4", "n5"]


def member(node: str, uid: int) -> str:
    return f"{node}/127.0.0.1:{9000 + uid}/u{uid}"


def row(pid, slaves=(), synced=(), policy=None, arguments=None, name="q"):
    return {
        "name": name,
        "vhost": "/",
        "durable": True,
        "auto_delete": False,
        "exclusive_owner": None,
        "arguments": dict(arguments or {}),
        "pid": pid,
        "slave_pids": list(slaves),
        "sync_slave_pids": list(synced),
        "policy": policy,
        "gm_pids": [],
        "state": "live",
    }


def pol(name, defn, pattern=".*", priority=0, vhost="/", apply_to="all"):
    return Policy(vhost, name, pattern, defn, priority, apply_to)


def placing(actions):
    """The actions other than definition pushes."""
    return [a for a in actions if not isinstance(a, PushDefinition)]


# ================================================================ records


def test_node_of_and_replicas_of():
    m1, m2, m3, m4 = (member(n, i) for i, n in enumerate(["n1", "n2", "n3", "n2"]))
    assert node_of(m2) == "n2"
    for bad in ("n1", "/x/y", "", None):
        with pytest.raises(ValueError):
            node_of(bad)
    rs, members, surplus = replicas_of(row(m1, [m2, m3, m4], [m3]))
    assert rs.master == "n1"
    assert rs.mirrors == (Replica("n2", False), Replica("n3", True))
    assert members == {"n2": m2, "n3": m3}
    assert surplus == [("n2", m4)]  # a second mirror on n2: the first listed is kept
    with pytest.raises(ValueError, match="no master"):
        replicas_of(row(None))


def test_argument_definition_pins_placement():
    assert argument_definition({}) is None
    assert argument_definition({"x-ha-policy": "all"}) == {"ha-mode": "all"}
    assert argument_definition({"x-ha-policy": "nodes", "x-ha-policy-params": ["a", "b"]}) == {
        "ha-mode": "nodes",
        "ha-params": ("a", "b"),
    }
    with pytest.raises(PolicyValidationError, match="x-ha-policy must be"):
        argument_definition({"x-ha-policy": "exactly"})
    with pytest.raises(PolicyValidationError, match="without x-ha-policy"):
        argument_definition({"x-ha-policy-params": ["a"]})
    with pytest.raises(PolicyValidationError, match="ha-params"):
        argument_definition({"x-ha-policy": "nodes"})
    p = pol("p", {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"})
    assert effective_placement_definition(p, {"x-ha-policy": "all"}) == {"ha-sync-mode": "automatic", "ha-mode": "all"}
    assert effective_placement_definition(p, {}) == p.definition.to_dict()
    assert effective_placement_definition(None, None) is None


# ================================================================ declare


def test_declare_without_policy_is_unmirrored_on_the_declaring_node():
    assert declare_placement(None, "n2", NODES, queue_name="q") == ["n2"]


def test_declare_with_policy_places_founders():
    founders = declare_placement(pol("ha", {"ha-mode": "exactly", "ha-params": 3}), "n1", NODES, queue_name="q")
    assert founders[0] == "n1" and len(founders) == 3 and len(set(founders)) == 3
    assert sorted(declare_placement(pol("ha", {"ha-mode": "all"}), "n3", NODES[:3], queue_name="q")) == NODES[:3]
    # locators: the queue argument overrides the policy's
    p = pol("ha", {"ha-mode": "exactly", "ha-params": 2, "queue-master-locator": "min-masters"})
    counts = {"n1": 3, "n2": 0, "n3": 1}
    assert declare_placement(p, "n1", NODES[:3], queue_name="q", masters_per_node=counts)[0] == "n2"
    assert (
        declare_placement(p, "n1", NODES[:3], queue_name="q", masters_per_node=counts, locator="client-local")[0]
        == "n1"
    )
    # x-ha-policy arguments win over the policy's mode
    assert sorted(
        declare_placement(
            p,
            "n1",
            NODES[:3],
            queue_name="q",
            masters_per_node=counts,
            arguments={"x-ha-policy": "nodes", "x-ha-policy-params": ["n1", "n3"]},
        )
    ) == ["n1", "n3"]


def test_declare_errors_name_the_problem():
    with pytest.raises(ValueError, match="not up"):
        declare_placement(None, "n9", NODES, queue_name="q")
    with pytest.raises(ValueError, match="rng"):
        declare_placement(pol("r", {"queue-master-locator": "random"}), "n1", NODES, queue_name="q")


# ================================================================ converge: unit rules


def test_only_the_master_node_acts():
    rows = [row(member("n2", 1))]
    policies = [pol("ha", {"ha-mode": "all"})]
    assert Converger("n1").converge(0.0, rows, policies, NODES[:3]) == []
    acts = Converger("n2").converge(0.0, rows, policies, NODES[:3])
    starts = sorted(a.node for a in acts if isinstance(a, StartMirrorOn))
    assert starts == ["n1", "n3"]
    assert RecordPolicy("/", "q", "ha") in acts
    start = next(a for a in acts if isinstance(a, StartMirrorOn))
    assert start.spec["name"] == "q" and start.spec["durable"] is True and "pid" not in start.spec


def test_in_flight_actions_are_not_repeated_until_retry_after():
    c = Converger("n1", retry_after=10.0)
    rows = [row(member("n1", 1))]
    policies = [pol("ha", {"ha-mode": "exactly", "ha-params": 2})]
    first = c.converge(0.0, rows, policies, NODES[:3])
    assert sum(isinstance(a, StartMirrorOn) for a in first) == 1
    assert c.converge(5.0, rows, policies, NODES[:3]) == []  # in flight
    again = c.converge(10.0, rows, policies, NODES[:3])  # lost: retried
    assert [type(a) for a in again] == [RecordPolicy, StartMirrorOn]
    # once the record shows the mirror and the policy, the queue is done
    target = next(a for a in first if isinstance(a, StartMirrorOn)).node
    done = [row(member("n1", 1), [member(target, 2)], [member(target, 2)], policy="ha")]
    assert placing(c.converge(11.0, done, policies, NODES[:3])) == []
    assert c.converge(12.0, done, policies, NODES[:3]) == []
    assert c.in_flight == {}


def test_definition_pushed_to_every_replica_when_it_or_the_replicas_change():
    c = Converger("n1")
    m1, m2 = member("n1", 1), member("n2", 2)
    p1 = [pol("ha", {"ha-mode": "all", "ha-sync-mode": "automatic"})]
    r = row(m1, [m2], [m2], policy="ha")
    pushes = [a for a in c.converge(0.0, [r], p1, ["n1", "n2"]) if isinstance(a, PushDefinition)]
    assert pushes == [PushDefinition("/", "q", (m1, m2), {"ha-mode": "all", "ha-sync-mode": "automatic"})]
    assert c.converge(1.0, [r], p1, ["n1", "n2"]) == []
    p2 = [pol("ha", {"ha-mode": "all", "ha-sync-mode": "manual"})]
    (push,) = c.converge(2.0, [r], p2, ["n1", "n2"])
    assert push.definition["ha-sync-mode"] == "manual" and push.members == (m1, m2)
    m3 = member("n3", 3)
    r3 = row(m1, [m2, m3], [m2], policy="ha")
    (push,) = c.converge(3.0, [r3], p2, ["n1", "n2", "n3"])
    assert push.members == (m1, m2, m3)
    # no policy: an empty definition; a start carries the definition for the new replica
    c2 = Converger("n1")
    acts = c2.converge(0.0, [row(m1)], [pol("x", {"ha-mode": "exactly", "ha-params": 2})], ["n1", "n2"])
    start = next(a for a in acts if isinstance(a, StartMirrorOn))
    assert start.definition == {"ha-mode": "exactly", "ha-params": 2}
    assert PushDefinition("/", "q", (m1,), {}) in Converger("n1").converge(0.0, [row(m1)], [], ["n1"])


def test_unmirrored_queue_drops_mirrors_only_when_policy_cleared():
    c = Converger("n1")
    m2, m3 = member("n2", 2), member("n3", 3)
    r = row(member("n1", 1), [m2, m3], [m2, m3], policy="ha")
    acts = c.converge(0.0, [r], [], NODES[:3])
    assert RecordPolicy("/", "q", None) in acts
    assert sorted(a.member for a in acts if isinstance(a, StopMirrorMember)) == [m2, m3]


def test_exactly_n_replaces_a_mirror_on_a_down_node():
    c = Converger("n1")
    m2, m3 = member("n2", 2), member("n3", 3)
    policies = [pol("ha", {"ha-mode": "exactly", "ha-params": 3})]
    r = row(member("n1", 1), [m2, m3], [m2, m3], policy="ha")
    assert placing(c.converge(0.0, [r], policies, ["n1", "n2", "n3", "n4"])) == []
    c.converge(0.5, [r], policies, ["n1", "n2", "n3", "n4"])
    acts = placing(c.converge(1.0, [r], policies, ["n1", "n2", "n4"]))  # n3 down
    assert [(type(a), a.node) for a in acts] == [(StartMirrorOn, "n4")]


def test_make_before_break_keeps_synchronised_surplus_until_replacement_synced():
    c = Converger("n1")
    m2, m3, m4 = member("n2", 2), member("n3", 3), member("n4", 4)
    policies = [pol("ha", {"ha-mode": "nodes", "ha-params": ["n1", "n3", "n4"]})]
    r = row(member("n1", 1), [m2, m3], [m2, m3], policy="ha")
    acts = placing(c.converge(0.0, [r], policies, NODES))
    assert [(type(a), a.node) for a in acts] == [(StartMirrorOn, "n4")]  # n2 (synced) stays for now
    r = row(member("n1", 1), [m2, m3, m4], [m2, m3], policy="ha")  # n4 joined, unsynchronised
    assert placing(c.converge(1.0, [r], policies, NODES)) == []
    r = row(member("n1", 1), [m2, m3, m4], [m2, m3, m4], policy="ha")
    assert placing(c.converge(2.0, [r], policies, NODES)) == [StopMirrorMember("/", "q", "n2", m2)]


def test_master_not_listed_reports_the_wanted_transfer_and_stops_nothing_synced():
    c = Converger("n1")
    m2 = member("n2", 2)
    policies = [pol("ha", {"ha-mode": "nodes", "ha-params": ["n2"]})]
    acts = placing(c.converge(0.0, [row(member("n1", 1), [m2], [m2], policy="ha")], policies, NODES[:3]))
    assert acts == [TransferMasterTo("/", "q", "n2", member("n1", 1))]


def test_surplus_duplicates_and_bad_records():
    c = Converger("n1")
    m2a, m2b, m1b = member("n2", 2), member("n2", 3), member("n1", 4)
    policies = [pol("ha", {"ha-mode": "all"})]
    acts = c.converge(0.0, [row(member("n1", 1), [m2a, m2b, m1b], [m2a], policy="ha")], policies, ["n1", "n2"])
    assert sorted(a.member for a in acts if isinstance(a, StopMirrorMember)) == sorted([m2b, m1b])
    acts = placing(c.converge(0.0, [row(member("n1", 1), ["garbage"], policy="ha")], policies, ["n1"]))
    assert len(acts) == 1 and isinstance(acts[0], BadRecord) and "garbage" in acts[0].error
    bad_args = row(member("n1", 1), policy="ha", arguments={"x-ha-policy": "sometimes"})
    acts = c.converge(0.0, [bad_args], policies, ["n1"])
    assert isinstance(acts[-1], BadRecord) and "x-ha-policy" in acts[-1].error


def test_pinned_queue_follows_its_arguments_not_the_policy():
    c = Converger("n1")
    policies = [pol("none-here", {"ha-mode": "exactly", "ha-params": 1})]
    pinned = row(member("n1", 1), arguments={"x-ha-policy": "nodes", "x-ha-policy-params": ["n1", "n2", "n3"]})
    acts = c.converge(0.0, [pinned], policies, NODES[:3])
    assert sorted(a.node for a in acts if isinstance(a, StartMirrorOn)) == ["n2", "n3"]


def test_converger_rejects_bad_arguments():
    with pytest.raises(ValueError, match="node"):
        Converger("")
    with pytest.raises(ValueError, match="retry_after"):
        Converger("n1", retry_after=0)


# ================================================================ property: convergence

POLICY_CHOICES = [
    None,
    {"ha-mode": "all"},
    {"ha-mode": "exactly", "ha-params": 1},
    {"ha-mode": "exactly", "ha-params": 2},
    {"ha-mode": "exactly", "ha-params": 3},
    {"ha-mode": "exactly", "ha-params": 4},
    {"ha-mode": "nodes", "ha-params": ["n1", "n2", "n3"]},
    {"ha-mode": "nodes", "ha-params": ["n4", "n5", "ghost"]},
]
RETRY = 5.0


class World:
    """One queue's record and the cluster around it (see the module docstring)."""

    def __init__(self):
        self.now = 0.0
        self.up = set(NODES)
        self.uid = 1
        self.policies: list[Policy] = []
        self.row = row(member("n1", 1))
        self.convergers = {n: Converger(n, retry_after=RETRY) for n in NODES}
        self.landing: list[StartMirrorOn] = []  # starts sent, replica not yet joined
        self.pushed: dict | None = None  # the definition last pushed to the replicas
        self.stops = 0
        self.transfers = 0

    # ---- helpers ----------------------------------------------------------
    def master(self) -> str:
        return node_of(self.row["pid"])

    def replica_nodes(self) -> list[str]:
        return [self.master()] + [node_of(m) for m in self.row["slave_pids"]]

    def synced_live(self) -> int:
        n = 1 if self.master() in self.up else 0
        return n + sum(1 for m in self.row["sync_slave_pids"] if node_of(m) in self.up)

    def check(self) -> None:
        nodes = self.replica_nodes()
        assert len(nodes) == len(set(nodes)), f"two replicas on one node: {self.row}"
        assert set(self.row["sync_slave_pids"]) <= set(self.row["slave_pids"])

    # ---- events -----------------------------------------------------------
    def set_policy(self, k: int) -> None:
        defn = POLICY_CHOICES[k % len(POLICY_CHOICES)]
        self.policies = [] if defn is None else [pol("p", defn)]

    def down(self, node: str) -> None:
        if node not in self.up or len(self.up) == 1:
            return
        self.up.discard(node)
        self.convergers[node] = Converger(node, retry_after=RETRY)  # its manager's memory is lost
        # death handling (GM view change): members on the node leave the record
        for key in ("slave_pids", "sync_slave_pids"):
            self.row[key] = [m for m in self.row[key] if node_of(m) != node]
        self._promote()

    def _promote(self) -> None:
        if self.master() in self.up:
            return
        mirrors = [Replica(node_of(m), m in self.row["sync_slave_pids"]) for m in self.row["slave_pids"]]
        cand = promotion_candidate(mirrors, self.up)
        if cand is None:
            return
        new = next(m for m in self.row["slave_pids"] if node_of(m) == cand)
        was_synced = new in self.row["sync_slave_pids"]
        for key in ("slave_pids", "sync_slave_pids"):
            self.row[key] = [m for m in self.row[key] if m != new]
        self.row["pid"] = new
        if not was_synced:  # an unsynchronised promotion loses what it lacked: the others are now behind
            self.row["sync_slave_pids"] = []

    def node_up(self, node: str) -> None:
        if node in self.up:
            return
        self.up.add(node)
        if self.master() == node:  # the master's node came back with nobody promoted: recovery
            self.uid += 1
            self.row["pid"] = member(node, self.uid)

    def round(self, lose: int = 0, delay: int = 0) -> list:
        """The master's node converges; ``lose``/``delay`` bit masks drop
        or hold back its starts and stops (by position)."""
        m = self.master()
        if m not in self.up:
            return []
        acts = self.convergers[m].converge(self.now, [dict(self.row)], self.policies, self.up)
        for other in self.up - {m}:
            assert self.convergers[other].converge(self.now, [dict(self.row)], self.policies, self.up) == []
        for i, a in enumerate(acts):
            bit = 1 << (i % 16)
            if isinstance(a, RecordPolicy):
                self.row["policy"] = a.policy
            elif isinstance(a, StartMirrorOn):
                assert a.node in self.up and a.node not in self.replica_nodes()
                if lose & bit:
                    continue
                self.landing.append(a)
                if not delay & bit:
                    self.land(len(self.landing) - 1)
            elif isinstance(a, PushDefinition):
                assert a.members == (self.row["pid"], *self.row["slave_pids"])
                self.pushed = a.definition
            elif isinstance(a, StopMirrorMember):
                assert a.node != m
                if lose & bit:
                    continue
                before = self.synced_live()
                self.row["slave_pids"] = [x for x in self.row["slave_pids"] if x != a.member]
                self.row["sync_slave_pids"] = [x for x in self.row["sync_slave_pids"] if x != a.member]
                assert not (before >= 1 and self.synced_live() == 0), "a stop removed the last synchronised replica"
                self.stops += 1
            elif isinstance(a, TransferMasterTo):
                # the master hands over to its synchronised mirror there and leaves
                assert a.member == self.row["pid"] and a.node in self.up
                target = next(x for x in self.row["sync_slave_pids"] if node_of(x) == a.node)
                if lose & bit:
                    continue
                for key in ("slave_pids", "sync_slave_pids"):
                    self.row[key] = [x for x in self.row[key] if x != target]
                self.row["pid"] = target
                self.transfers += 1
        self.check()
        return acts

    def land(self, i: int) -> None:
        """A start's replica joins (if its node is up and hosts no replica of the queue)."""
        if not self.landing:
            return
        a = self.landing.pop(i % len(self.landing))
        if a.node in self.up and a.node not in self.replica_nodes():
            self.uid += 1
            self.row["slave_pids"].append(member(a.node, self.uid))
        self.check()

    def sync(self, k: int = -1) -> None:
        """Mirrors on up nodes finish syncing (all, or the k-th unsynchronised)."""
        todo = [m for m in self.row["slave_pids"] if m not in self.row["sync_slave_pids"] and node_of(m) in self.up]
        if k >= 0 and todo:
            todo = [todo[k % len(todo)]]
        self.row["sync_slave_pids"] += todo

    def step(self, ev: tuple) -> None:
        kind, arg = ev
        self.now += 0.5 + (arg % 4)
        if kind == "down":
            self.down(NODES[arg % len(NODES)])
        elif kind == "up":
            self.node_up(NODES[arg % len(NODES)])
        elif kind == "policy":
            self.set_policy(arg)
        elif kind == "round":
            self.round(lose=arg & 0xFF, delay=(arg >> 8) & 0xFF)
        elif kind == "land":
            self.land(arg)
        elif kind == "sync":
            self.sync(arg)

    # ---- the end ----------------------------------------------------------
    def settle(self) -> None:
        """Nodes fixed, everything delivered, mirrors synchronise between rounds."""
        if self.master() not in self.up:
            self.node_up(self.master())
        while self.landing:
            self.land(0)
        quiet = 0
        for _ in range(40):
            self.now += 2.0
            acts = self.round()
            self.sync()
            stuck = all(isinstance(a, PushDefinition) for a in acts)
            quiet = quiet + 1 if stuck else 0
            if quiet >= 3:
                break
        assert quiet >= 3, f"no convergence: {self.row} policies {self.policies}"
        self.check_final()

    def check_final(self) -> None:
        policy = match(self.policies, "/", "q")
        assert self.row["policy"] == (None if policy is None else policy.name)
        assert self.pushed == ({} if policy is None else policy.definition.to_dict()), "replicas told the definition"
        defn = {} if policy is None else policy.definition.to_dict()
        mode = defn.get("ha-mode")
        nodes = self.replica_nodes()
        assert all(n in self.up for n in nodes)
        assert set(self.row["sync_slave_pids"]) == set(self.row["slave_pids"]), "all mirrors synchronised"
        if mode is None:
            assert nodes == [self.master()]
        elif mode == "all":
            assert set(nodes) == self.up
        elif mode == "exactly":
            assert len(nodes) == min(defn["ha-params"], len(self.up))
        else:
            listed_up = set(defn["ha-params"]) & self.up
            if not listed_up:
                assert nodes == [self.master()]
            else:  # the master moved to a listed node if it was not on one
                assert self.master() in listed_up and set(nodes) == listed_up


EVENTS = st.tuples(
    st.sampled_from(["down", "up", "policy", "round", "round", "land", "sync"]), st.integers(0, 2**16 - 1)
)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, len(POLICY_CHOICES) - 1), st.lists(EVENTS, max_size=40))
def test_placement_converges_from_any_node_up_down_sequence(first_policy, events):
    w = World()
    w.set_policy(first_policy)
    for ev in events:
        w.step(ev)
    w.settle()


@pytest.mark.parametrize("seed", range(25), ids=lambda s: f"seed={s}")
def test_placement_converges_random_walk(seed):
    rng = random.Random(seed)
    w = World()
    w.set_policy(rng.randrange(len(POLICY_CHOICES)))
    kinds = ["down", "up", "policy", "round", "round", "round", "land", "sync", "sync"]
    for _ in range(120):
        w.step((rng.choice(kinds), rng.randrange(2**16)))
    w.settle()


def test_a_restarted_node_gets_its_start_again_at_once():
    """A start sent to a node whose manager then turns out to be its old,
    dead one (the node restarted) is issued again as soon as the manager is
    told so, not after retry_after."""
    c = Converger("n1", retry_after=10.0)
    rows = [row(member("n1", 1))]
    policies = [pol("ha", {"ha-mode": "exactly", "ha-params": 2})]
    first = [a for a in c.converge(0.0, rows, policies, NODES[:2]) if isinstance(a, StartMirrorOn)]
    assert [a.node for a in first] == [NODES[1]]
    assert not [a for a in c.converge(1.0, rows, policies, NODES[:2]) if isinstance(a, StartMirrorOn)]
    c.forget_node(NODES[1])
    again = [a for a in c.converge(1.5, rows, policies, NODES[:2]) if isinstance(a, StartMirrorOn)]
    assert [a.node for a in again] == [NODES[1]]


def test_a_nodes_policy_without_the_masters_node_moves_the_master_once():
    """Master on n1, policy nodes [n4, n5, ghost]: mirrors start on n4 and n5,
    synchronise, then the master hands over to the first listed node (n4) and
    n1 holds nothing any more."""
    w = World()
    w.set_policy(POLICY_CHOICES.index({"ha-mode": "nodes", "ha-params": ["n4", "n5", "ghost"]}))
    w.settle()
    assert w.transfers == 1 and w.master() == "n4" and sorted(w.replica_nodes()) == ["n4", "n5"]
