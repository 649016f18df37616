"""The resource alarm core (mirrorq.node.alarms): limits and their parsing,
thresholds, the cluster-wide union, and alarms that die with their node."""

from __future__ import annotations

import pytest

from mirrorq.node import alarms as A
from mirrorq.node.config import ConfigError, from_mapping
from mirrorq.sansio import Emit, Send

GiB = 1 << 30
RAM = 8 * GiB


def events(actions, cls=None):
    evs = [a.event for a in actions if isinstance(a, Emit)]
    return [e for e in evs if cls is None or isinstance(e, cls)]


def sends(actions):
    return [(a.dst, a.msg) for a in actions if isinstance(a, Send)]


# ---- limits --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, value",
    [
        (0, 0),
        (1234, 1234),
        ("1234", 1234),
        ("50MB", 50_000_000),
        ("50mb", 50_000_000),
        ("1GiB", GiB),
        ("1G", GiB),
        ("512k", 512 * 1024),
        ("512KiB", 512 * 1024),
        ("2kB", 2000),
        ("1.5GB", 1_500_000_000),
        ("3 MiB", 3 << 20),
        ("1TB", 10**12),
        (2.0, 2),
    ],
)
def test_sizes_take_rabbitmq_units(text, value):
    assert A.parse_size(text) == value


@pytest.mark.parametrize("bad", [-1, "", "MB", "12 parsecs", "1e3", True, None, [1], 1.5])
def test_bad_sizes_are_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match="size|negative"):
        A.parse_size(bad)


def test_memory_watermark_forms_and_limits():
    assert A.parse_memory_watermark(0.4).limit(RAM) == int(RAM * 0.4)
    assert A.parse_memory_watermark(0).limit(RAM) == 0
    assert A.parse_memory_watermark(1).limit(RAM) == RAM
    assert A.parse_memory_watermark({"absolute": "1GiB"}).limit(RAM) == GiB
    assert A.parse_memory_watermark({"absolute": 12345}).limit(RAM) == 12345
    assert A.parse_memory_watermark({"relative": 0.5}).limit(RAM) == RAM // 2
    assert A.parse_memory_watermark({"absolute": "1GiB"}).setting() == {"absolute": GiB}
    assert A.parse_memory_watermark(0.4).setting() == 0.4
    for bad in (
        1.5,
        -0.1,
        "0.4",
        {"absolute": "lots"},
        {"absolute": 1, "relative": 0.1},
        {"other": 1},
        True,
        float("nan"),
    ):
        with pytest.raises(ValueError):
            A.parse_memory_watermark(bad)


def test_disk_free_limit_forms_and_limits():
    assert A.parse_disk_free_limit(A.DEFAULT_DISK_FREE_LIMIT).limit(RAM) == 50_000_000
    assert A.parse_disk_free_limit("1GB").limit(RAM) == 10**9
    assert A.parse_disk_free_limit({"absolute": "2GiB"}).limit(RAM) == 2 * GiB
    assert A.parse_disk_free_limit({"mem_relative": 1.5}).limit(RAM) == int(RAM * 1.5)
    assert A.parse_disk_free_limit({"mem_relative": 1.0}).setting() == {"mem_relative": 1.0}
    for bad in (-5, "fifty", {"mem_relative": -1}, {"mem_relative": "1"}, {"relative": 1.0}):
        with pytest.raises(ValueError):
            A.parse_disk_free_limit(bad)


def test_node_yaml_takes_the_limits_and_names_the_key_of_a_bad_one():
    cfg = from_mapping({"name": "n1", "vm_memory_high_watermark": {"absolute": "1GiB"}, "disk_free_limit": "1GB"})
    assert cfg.vm_memory_high_watermark == {"absolute": "1GiB"} and cfg.disk_free_limit == "1GB"
    assert from_mapping(cfg.to_dict()) == cfg  # what the launcher writes reads back the same
    default = from_mapping({"name": "n1"})
    assert (default.vm_memory_high_watermark, default.disk_free_limit) == (0.4, 50_000_000)
    with pytest.raises(ConfigError, match="key 'vm_memory_high_watermark'.*from 0 to 1"):
        from_mapping({"name": "n1", "vm_memory_high_watermark": 4})
    with pytest.raises(ConfigError, match="key 'disk_free_limit'.*size"):
        from_mapping({"name": "n1", "disk_free_limit": "a lot"})


def test_blocked_reason_names_every_resource_as_rabbitmq_does():
    assert A.blocked_reason([]) == ""
    assert A.blocked_reason(["disk"]) == "low on disk"
    assert A.blocked_reason(iter(["disk", "memory"])) == "low on memory & low on disk"


# ---- one node's checks ---------------------------------------------------------------------------
def core(**kw) -> A.Alarms:
    return A.Alarms("n1", 1, RAM, **kw)


def test_memory_alarm_above_the_watermark_and_cleared_at_or_below_it():
    a = core(memory={"absolute": 1000})
    assert events(a.check(0.0, 1000, 10**12), A.AlarmSet) == []  # at the limit: not above it
    out = a.check(1.0, 1001, 10**12)
    assert events(out, A.AlarmSet) == [A.AlarmSet("n1", "memory", (("used", 1001), ("limit", 1000)))]
    assert events(out, A.ClusterAlarms) == [A.ClusterAlarms((("n1", "memory"),))]
    assert a.status()["mem_alarm"] and a.resources() == {"memory"}
    assert events(a.check(2.0, 5000, 10**12)) == []  # still above: nothing new
    out = a.check(3.0, 999, 10**12)
    assert events(out, A.AlarmCleared) == [A.AlarmCleared("n1", "memory", (("used", 999), ("limit", 1000)))]
    assert events(out, A.ClusterAlarms) == [A.ClusterAlarms(())] and not a.status()["mem_alarm"]


def test_disk_alarm_below_the_free_limit():
    a = core(disk=1000)
    assert events(a.check(0.0, 0, 1000)) == []  # at the limit: not below it
    assert events(a.check(1.0, 0, 999), A.AlarmSet) == [A.AlarmSet("n1", "disk", (("free", 999), ("limit", 1000)))]
    assert a.status()["disk_free_alarm"] and a.status()["disk_free"] == 999
    assert events(a.check(2.0, 0, 1000), A.AlarmCleared)


def test_a_figure_that_could_not_be_read_neither_raises_nor_clears():
    a = core(memory={"absolute": 10}, disk=10)
    a.check(0.0, 11, 9)
    assert a.resources() == {"memory", "disk"}
    assert events(a.check(1.0, None, None)) == [] and a.resources() == {"memory", "disk"}


def test_a_watermark_of_zero_raises_the_memory_alarm_at_once():
    a = core(memory=0.0)
    assert a.mem_limit == 0 and events(a.check(0.0, 1, 10**12), A.AlarmSet)


def test_a_limit_changed_at_run_time_applies_at_the_next_check():
    a = core()
    a.check(0.0, 100 << 20, 10**12)
    assert a.resources() == set()
    a.set_limit("memory", {"absolute": "1MiB"})
    assert a.mem_limit == 1 << 20 and a.resources() == set()  # not before a check
    assert events(a.check(0.1, 100 << 20, 10**12), A.AlarmSet)
    a.set_limit("memory", 0.4)
    assert events(a.check(0.2, 100 << 20, 10**12), A.AlarmCleared)
    a.set_limit("disk", {"mem_relative": 1.0})
    assert a.disk_free_limit == RAM and events(a.check(0.3, 0, RAM - 1), A.AlarmSet)
    with pytest.raises(ValueError):
        a.set_limit("disk", "lots")
    with pytest.raises(ValueError, match="unknown resource"):
        a.set_limit("cpu", 1)


def test_changes_go_to_the_peers_up_at_once_and_again_every_resend_interval():
    a = core(memory={"absolute": 10})
    a.node_up(0.0, "n2", 7)
    a.node_up(0.0, "n3", 8)
    out = a.check(0.0, 11, 10**12)
    assert [d for d, _ in sends(out)] == ["n2", "n3"] and sends(out)[0][1].resources == ("memory",)
    assert sends(a.check(1.0, 12, 10**12)) == []  # nothing changed, sent just now
    again = sends(a.check(A.RESEND_INTERVAL + 0.1, 12, 10**12))
    assert [d for d, _ in again] == ["n2", "n3"] and again[0][1].seq > sends(out)[0][1].seq
    a.node_down(6.0, "n3", 8)
    assert [d for d, _ in sends(a.check(6.0, 1, 10**12))] == ["n2"]  # the clear; n3 is down


# ---- the cluster ---------------------------------------------------------------------------------
class Net:
    """Three cores delivering each other's sends (lost ones when told to)."""

    def __init__(self, names=("n1", "n2", "n3")) -> None:
        self.cores = {n: A.Alarms(n, 100 + i, RAM, memory={"absolute": 1000}, disk=1000) for i, n in enumerate(names)}
        self.lose: set[str] = set()  # destinations whose messages are lost
        self.log: dict[str, list] = {n: [] for n in names}
        for n in names:
            for m in names:
                if m != n:
                    self.run(n, self.cores[n].node_up(0.0, m, self.cores[m].incarnation))

    def run(self, node: str, actions: list, now: float = 0.0) -> None:
        for a in actions:
            if isinstance(a, Send):
                if a.dst in self.lose or a.dst not in self.cores:
                    continue
                self.run(a.dst, self.cores[a.dst].receive(now, node, a.msg), now)
            elif isinstance(a, Emit):
                self.log[node].append(a.event)

    def check(self, node: str, now: float, mem: int = 0, free: int = 10**9) -> None:
        self.run(node, self.cores[node].check(now, mem, free), now)

    def unions(self) -> dict:
        return {n: c.union for n, c in self.cores.items()}


def test_an_alarm_of_one_node_is_in_every_nodes_union_until_it_clears():
    net = Net()
    net.check("n1", 1.0, mem=5000)
    assert set(net.unions().values()) == {(("n1", "memory"),)}
    assert A.AlarmSet("n1", "memory") in net.log["n2"] and A.ClusterAlarms((("n1", "memory"),)) in net.log["n3"]
    net.check("n3", 1.0, free=10)
    assert set(net.unions().values()) == {(("n1", "memory"), ("n3", "disk"))}
    net.check("n1", 2.0, mem=10)
    assert set(net.unions().values()) == {(("n3", "disk"),)}
    assert net.cores["n2"].resources() == {"disk"}
    net.check("n3", 2.0)
    assert set(net.unions().values()) == {()}


def test_an_alarm_of_a_node_that_goes_down_clears_and_its_late_messages_are_ignored():
    net = Net()
    net.check("n1", 1.0, mem=5000)
    n2 = net.cores["n2"]
    late = A.AlarmState(net.cores["n1"].incarnation, 99, ("memory",))  # still on its way from n1
    out = n2.node_down(2.0, "n1", net.cores["n1"].incarnation)
    assert n2.union == () and events(out, A.ClusterAlarms) == [A.ClusterAlarms(())]
    assert A.AlarmCleared("n1", "memory", reason="node down") in events(out)
    assert n2.receive(2.1, "n1", late) == [] and n2.union == ()
    # n1 restarts (a new incarnation): its new life's alarms count again
    n1 = A.Alarms("n1", 500, RAM, memory={"absolute": 1000})
    net.cores["n1"] = n1
    net.run("n2", n2.node_up(3.0, "n1", 500))
    net.run("n1", n1.node_up(3.0, "n2", n2.incarnation))
    net.check("n1", 3.0, mem=5000)
    assert n2.union == (("n1", "memory"),)
    assert n2.receive(3.1, "n1", late) == [] and n2.union == (("n1", "memory"),)  # the old life stays dead


def test_a_partitioned_node_back_in_the_same_life_is_heard_again():
    net = Net()
    n2 = net.cores["n2"]
    inc = net.cores["n1"].incarnation
    n2.node_down(1.0, "n1", inc)  # a partition: n2 timed n1 out
    net.run("n2", n2.node_up(2.0, "n1", inc))  # healed: same incarnation
    net.check("n1", 3.0, mem=5000)
    assert n2.union == (("n1", "memory"),)


def test_a_state_heard_before_the_peer_is_up_counts_once_it_is():
    n2 = A.Alarms("n2", 1, RAM)
    assert n2.receive(0.0, "n1", A.AlarmState(77, 1, ("disk",))) == [] and n2.union == ()
    out = n2.node_up(0.1, "n1", 77)
    assert n2.union == (("n1", "disk"),) and A.AlarmSet("n1", "disk") in events(out)
    assert sends(out) == [("n1", A.AlarmState(1, 0, ()))]  # and n1 hears n2's state at once


def test_an_older_state_arriving_late_is_ignored():
    n2 = A.Alarms("n2", 1, RAM)
    n2.node_up(0.0, "n1", 5)
    n2.receive(0.0, "n1", A.AlarmState(5, 3, ()))
    assert n2.receive(0.1, "n1", A.AlarmState(5, 2, ("memory",))) == [] and n2.union == ()


def test_a_lost_message_is_repaired_by_the_next_resend():
    net = Net()
    net.lose = {"n2"}
    net.check("n1", 1.0, mem=5000)
    assert net.cores["n2"].union == () and net.cores["n3"].union == (("n1", "memory"),)
    net.lose = set()
    net.check("n1", 1.0 + A.RESEND_INTERVAL / 2, mem=5000)
    assert net.cores["n2"].union == ()  # not yet resent
    net.check("n1", 1.0 + A.RESEND_INTERVAL, mem=5000)
    assert net.cores["n2"].union == (("n1", "memory"),)


def test_status_has_rabbitmqs_node_items_and_the_cluster_alarms():
    net = Net()
    net.check("n1", 1.0, mem=5000, free=10**9)
    st = net.cores["n2"].status()
    assert st["alarms"] == [{"node": "n1", "resource": "memory"}]
    assert not st["mem_alarm"] and not st["disk_free_alarm"]
    mine = net.cores["n1"].status()
    assert mine["mem_alarm"] and mine["mem_used"] == 5000 and mine["mem_limit"] == 1000
    assert mine["disk_free"] == 10**9 and mine["disk_free_limit"] == 1000


def test_the_disk_is_checked_more_often_the_closer_it_is_to_its_limit():
    a = core(disk=1000)
    assert a.disk_check_interval() == A.CHECK_INTERVAL  # nothing measured yet
    a.check(0.0, 0, 1000 + 10 * A.FAST_DISK_WRITE_RATE)
    assert a.disk_check_interval() == A.CHECK_INTERVAL  # far from it
    a.check(0.1, None, 1000 + A.FAST_DISK_WRITE_RATE // 2)
    assert a.disk_check_interval() == pytest.approx(0.5)
    a.check(0.2, None, 1000 + A.FAST_DISK_WRITE_RATE // 100)
    assert a.disk_check_interval() == A.MIN_DISK_CHECK_INTERVAL
    a.check(0.3, None, 10)  # alarmed: watched closely until it clears
    assert a.disk_check_interval() == A.MIN_DISK_CHECK_INTERVAL and a.resources() == {"disk"}
