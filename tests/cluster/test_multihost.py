"""Three "hosts": each node in its own network namespace with its own address
(mirrorq.admin.netns), run by ``mirrorq-server`` from its own config file
(mirrorq.admin.lab), reached from the root namespace over a bridge by pika
and by ``mirrorctl --address``.

Two stories.  One: publish with confirms to a mirrored queue and a quorum queue;
``kill -9`` the node of the mirrored queue's master and start it again;
stop a node, give its namespace a NEW address and its config the new host,
start it: it rejoins under its name (its peers know it at the new address,
the registry's voters are unchanged, its replicas come back); consume
everything through the moved node's new address: every confirmed message
is there, none twice.  Two: the README's rolling restart -- every node in
turn stopped and started, the next only once the replicas are back --
under a client publishing with confirms throughout: every confirmed
message is there, none twice.  Three: a 30 s silent cut of the master's
host (packets dropped in its namespace): the majority carries on, the cut
node pauses and rejoins, nothing confirmed is lost.

Needs root and ``ip netns`` (CI runs as root): without them the test FAILS
naming what is missing, it does not skip.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

from mirrorq.admin import netns
from mirrorq.admin.cluster import poll
from mirrorq.admin.lab import ADMIN_PORT, LabCluster

pytestmark = pytest.mark.cluster

USER, PASSWORD = "mh", "mh-secret"
CLASSIC, QUORUM = "mh.classic", "mh.quorum"
BATCH = 150


def ctl(capsys, lc: LabCluster, via: int, *argv: str):
    """``mirrorctl --address NODE --secret-file S --formatter json ARGV`` (must succeed)."""
    from ctl.mirrorctl import main

    capsys.readouterr()
    rc = main(
        [
            "--address",
            f"{lc.lab.address(via)}:{ADMIN_PORT}",
            "--secret-file",
            str(lc.secret),
            "--formatter",
            "json",
            *argv,
        ]
    )
    cap = capsys.readouterr()
    assert rc == 0, f"mirrorctl {' '.join(argv)} via node{via} failed ({rc}): {cap.err}"
    return json.loads(cap.out) if cap.out.strip().startswith(("[", "{")) else None


@contextlib.contextmanager
def channel(lc: LabCluster, i: int):
    import pika

    host, port = lc.amqp_address(i)
    conn = pika.BlockingConnection(
        pika.ConnectionParameters(
            host,
            port,
            credentials=pika.PlainCredentials(USER, PASSWORD),
            blocked_connection_timeout=60,
            connection_attempts=3,
            retry_delay=1,
        )
    )
    try:
        ch = conn.channel()
        yield ch
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def publish(lc: LabCluster, i: int, tag: str, confirmed: dict[str, set[str]]) -> None:
    """BATCH persistent messages to each queue through node ``i``, with
    confirms (pika raises on a nack or a return: only confirmed ones are recorded)."""
    import pika

    with channel(lc, i) as ch:
        ch.confirm_delivery()
        for q in (CLASSIC, QUORUM):
            for k in range(BATCH):
                body = f"{tag}-{k}"
                ch.basic_publish("", q, body.encode(), pika.BasicProperties(delivery_mode=2), mandatory=True)
                confirmed[q].add(body)


def drain(lc: LabCluster, i: int, q: str) -> list[str]:
    got: list[str] = []
    with channel(lc, i) as ch:
        while True:
            m, _props, body = ch.basic_get(q, auto_ack=False)
            if m is None:
                return got
            got.append(body.decode())
            ch.basic_ack(m.delivery_tag)


def queues(capsys, lc: LabCluster, via: int) -> dict[str, dict]:
    rows = ctl(capsys, lc, via, "list_queues", "name", "pid", "synchronised_slave_pids", "leader", "online", "messages")
    return {r["name"]: r for r in rows}


def node_of(member) -> str:
    return str(member or "").split("/")[0]


def settled(capsys, lc: LabCluster, via: int, nodes: set[str], total: int) -> tuple[bool, dict]:
    """Both queues hold ``total`` messages, the mirrored one's master and
    synchronised mirrors cover ``nodes``, the quorum queue has a leader and
    every one of ``nodes`` online."""
    try:
        qs = queues(capsys, lc, via)
    except AssertionError as e:  # a registry read during a leader change may time out: ask again
        return False, {"error": str(e)}
    c, q = qs.get(CLASSIC, {}), qs.get(QUORUM, {})
    replicas = {node_of(c.get("pid"))} | {node_of(m) for m in c.get("synchronised_slave_pids") or []}
    ok = (
        replicas == nodes
        and c.get("messages") == total
        and q.get("messages") == total
        and bool(q.get("leader"))
        and set(q.get("online") or []) == nodes
    )
    return ok, qs


def wait_settled(capsys, lc, via, nodes, total, timeout=60.0) -> None:
    seen: dict = {}

    def check() -> bool:
        ok, seen["qs"] = settled(capsys, lc, via, nodes, total)
        return ok

    assert poll(check, timeout, step=0.5), f"queues did not settle on {sorted(nodes)} with {total}: {seen.get('qs')}"


def need_namespaces() -> None:
    """Fail (never skip) where a lab cannot be made; remove a killed run's leftovers."""
    why = netns.unavailable()
    if why:
        pytest.fail(f"the multi-host test needs network namespaces (root, iproute2): {why}")
    netns.cleanup_stale()


def start_with_queues(capsys, lc: LabCluster) -> None:
    """Start the lab's nodes; a user for the clients; CLASSIC mirrored on all
    three (automatic sync) and QUORUM on all three, empty and settled."""
    lc.start()
    lc.wait_all_up(60)
    ctl(capsys, lc, 1, "add_user", USER, PASSWORD)
    ctl(capsys, lc, 1, "set_permissions", USER, ".*", ".*", ".*")
    ctl(capsys, lc, 1, "set_policy", "ha-mh", r"^mh\.classic$", '{"ha-mode": "all", "ha-sync-mode": "automatic"}')
    with channel(lc, 1) as ch:
        ch.queue_declare(CLASSIC, durable=True)
        ch.queue_declare(QUORUM, durable=True, arguments={"x-queue-type": "quorum"})
    wait_settled(capsys, lc, 1, {"node1", "node2", "node3"}, 0)


def test_three_namespaces_kill_restart_move_nothing_confirmed_lost(capsys, data_root):
    need_namespaces()
    all3 = {"node1", "node2", "node3"}
    confirmed: dict[str, set[str]] = {CLASSIC: set(), QUORUM: set()}
    with LabCluster(3, data_root) as lc:
        addresses = {i: lc.lab.address(i) for i in (1, 2, 3)}
        assert len(set(addresses.values())) == 3 and not any(a.startswith("127.") for a in addresses.values())
        start_with_queues(capsys, lc)

        publish(lc, 1, "a", confirmed)

        # kill -9 the node of the mirrored queue's master; the others carry on
        master = node_of(queues(capsys, lc, 2)[CLASSIC]["pid"])
        victim = lc.index(master)
        survivor = next(i for i in (1, 2, 3) if i != victim)
        lc.kill(victim)
        wait_settled(capsys, lc, survivor, all3 - {master}, BATCH)
        publish(lc, survivor, "b", confirmed)
        lc.start(victim)
        lc.wait_all_up(60)
        wait_settled(capsys, lc, survivor, all3, 2 * BATCH)

        # move a node: stop it, new address in its namespace and its config, start it
        moved = next(i for i in (1, 2, 3) if i != victim)
        other = next(i for i in (1, 2, 3) if i not in (moved,))
        old = lc.lab.address(moved)
        assert lc.stop(moved) == 0  # SIGTERM: a clean stop, exit 0
        new = lc.move(moved)
        assert new != old
        publish(lc, other, "c", confirmed)
        lc.start(moved)
        lc.wait_all_up(60)
        name = lc.names[moved - 1]
        st = lc.cluster(via=other)
        assert st.admin_address(name) == (new, ADMIN_PORT), "its peers know the moved node at its new address"
        me = lc.cluster(via=moved).status(name)
        assert me is not None and me.name == name and me.config["host"] == new
        assert sorted(me.registry["voters"]) == sorted(all3), me.registry
        wait_settled(capsys, lc, moved, all3, 3 * BATCH)

        # everything confirmed is there, once, through the moved node's new address
        for q in (CLASSIC, QUORUM):
            got = drain(lc, moved, q)
            assert len(got) == len(set(got)), f"{q}: duplicates"
            assert set(got) == confirmed[q], (
                f"{q}: lost {sorted(confirmed[q] - set(got))[:10]}, unexpected {sorted(set(got) - confirmed[q])[:10]}"
            )
            assert len(confirmed[q]) == 3 * BATCH
    ns, links = netns.leftovers()
    assert not [n for n in ns + links if n.startswith(lc.lab.name)], "the lab's teardown left names behind"


class _RollingPublisher(threading.Thread):
    """Publishes with confirms (one at a time) to both queues, alternately,
    while the nodes restart one after another: when its node goes away it
    connects to the next one (as a client with a list of hosts does).  A
    publish whose confirm did not come before its connection broke is
    *maybe* in the queue; a confirmed one must be."""

    def __init__(self, lc: LabCluster, first: int) -> None:
        super().__init__(daemon=True)
        self.lc, self.node = lc, first
        self.confirmed: dict[str, set[str]] = {CLASSIC: set(), QUORUM: set()}
        self.maybe: dict[str, set[str]] = {CLASSIC: set(), QUORUM: set()}
        self.stop = threading.Event()
        self.reconnects = 0
        self.errors: list[str] = []

    def run(self) -> None:
        import pika

        n = 0
        while not self.stop.is_set():
            try:
                with channel(self.lc, self.node) as ch:
                    ch.confirm_delivery()
                    while not self.stop.is_set():
                        q = (CLASSIC, QUORUM)[n % 2]
                        body = f"r-{n}"
                        n += 1
                        self.maybe[q].add(body)
                        ch.basic_publish("", q, body.encode(), pika.BasicProperties(delivery_mode=2), mandatory=True)
                        self.maybe[q].discard(body)
                        self.confirmed[q].add(body)
            except Exception as e:  # noqa: BLE001 -- its node went away: the next one
                self.errors.append(f"node{self.node}: {type(e).__name__}: {e}"[:200])
                self.reconnects += 1
                self.node = self.node % 3 + 1
                self.stop.wait(0.5)

    def total(self) -> int:
        return sum(len(s) for s in self.confirmed.values())


def wait_replicas(capsys, lc: LabCluster, via: int, nodes: set[str], timeout: float = 90.0) -> None:
    """The mirrored queue's master and synchronised mirrors cover ``nodes``
    and the quorum queue has a leader and every one of ``nodes`` online
    (whatever the counts: a publisher is running)."""
    seen: dict = {}

    def check() -> bool:
        try:
            qs = queues(capsys, lc, via)
        except AssertionError as e:
            seen["qs"] = str(e)
            return False
        seen["qs"] = qs
        c, q = qs.get(CLASSIC, {}), qs.get(QUORUM, {})
        replicas = {node_of(c.get("pid"))} | {node_of(m) for m in c.get("synchronised_slave_pids") or []}
        return replicas == nodes and bool(q.get("leader")) and set(q.get("online") or []) == nodes

    assert poll(check, timeout, step=0.5), f"replicas did not come back on {sorted(nodes)}: {seen.get('qs')}"


def test_a_rolling_restart_of_every_node_under_confirmed_publishes_loses_nothing(capsys, data_root):
    """README's rolling restart, done as an operator would: each node in turn
    is stopped (SIGTERM) and started again, and the next waits until its
    mirrors are synchronised and its quorum members online again, while a
    client publishes with confirms all along (moving to another node when
    its own goes).  Every confirmed message is there afterwards, once."""
    need_namespaces()
    all3 = {"node1", "node2", "node3"}
    with LabCluster(3, data_root) as lc:
        start_with_queues(capsys, lc)
        pub = _RollingPublisher(lc, first=2)
        pub.start()
        try:
            for i in (1, 2, 3):
                before = pub.total()
                poll(lambda b=before: pub.total() >= b + 50, 60, step=0.1)
                assert pub.total() >= before + 50, f"no publish confirmed before node{i}'s restart: {pub.errors[-3:]}"
                assert lc.stop(i) == 0  # SIGTERM: a clean stop, exit 0
                lc.start(i)
                lc.wait_all_up(60)
                wait_replicas(capsys, lc, i % 3 + 1, all3)
            before = pub.total()
            poll(lambda: pub.total() >= before + 50, 60, step=0.1)
            assert pub.total() >= before + 50, f"no publish confirmed after the last restart: {pub.errors[-3:]}"
        finally:
            pub.stop.set()
            pub.join(60)
        assert not pub.is_alive()
        assert pub.reconnects >= 1, "the publisher's own node never restarted under it"
        for q in (CLASSIC, QUORUM):
            got = drain(lc, 1, q)
            assert len(got) == len(set(got)), f"{q}: duplicates {sorted(b for b in set(got) if got.count(b) > 1)[:10]}"
            lost = pub.confirmed[q] - set(got)
            unexpected = set(got) - pub.confirmed[q] - pub.maybe[q]
            assert not lost and not unexpected, f"{q}: lost {sorted(lost)[:10]}, unexpected {sorted(unexpected)[:10]}"
        print(f"rolling restart: {pub.total()} confirmed, {pub.reconnects} reconnects")
    ns, links = netns.leftovers()
    assert not [n for n in ns + links if n.startswith(lc.lab.name)], "the lab's teardown left names behind"


#: how long the lab's cut lasts: longer than the ~20 s that used to freeze a majority
CUT_SECONDS = 30.0


def test_a_silent_cut_of_the_masters_host_the_majority_serves_and_nothing_confirmed_is_lost(capsys, data_root):
    """A partition on the namespaces (issue #34 item 5): the host of the
    mirrored queue's master silently loses its peers (packets dropped both
    ways, iptables in its namespace) for CUT_SECONDS.  The cut node pauses
    (pause_minority); the two others promote a mirror, elect a quorum
    leader and take confirmed publishes; after the heal the cut node
    rejoins with no operator step, and every confirmed message is there,
    once."""
    need_namespaces()
    all3 = {"node1", "node2", "node3"}
    confirmed: dict[str, set[str]] = {CLASSIC: set(), QUORUM: set()}
    with LabCluster(3, data_root) as lc:
        start_with_queues(capsys, lc)
        publish(lc, 1, "a", confirmed)

        master = node_of(queues(capsys, lc, 1)[CLASSIC]["pid"])
        victim = lc.index(master)
        survivor = next(i for i in (1, 2, 3) if i != victim)
        lc.lab.cut(victim, mode="drop")
        cut_at = time.monotonic()
        try:
            # the majority: a new master and quorum leader among the two, publishes confirmed
            wait_settled(capsys, lc, survivor, all3 - {master}, BATCH, timeout=CUT_SECONDS)
            publish(lc, survivor, "b", confirmed)
            # the minority: the cut node says it is paused, to tools that still reach it
            seen: dict = {}

            def paused() -> bool:
                st = lc.cluster(via=victim).status(master)
                seen["partition"] = None if st is None else st.partition
                return st is not None and bool(st.partition.get("paused"))

            assert poll(paused, CUT_SECONDS, step=0.5), f"{master} did not pause when cut off: {seen}"
            # the fault lasts its full length, whatever the checks took
            time.sleep(max(0.0, cut_at + CUT_SECONDS - time.monotonic()))
        finally:
            lc.lab.heal(victim)
        lc.wait_all_up(60)
        wait_settled(capsys, lc, victim, all3, 2 * BATCH, timeout=90)
        for q in (CLASSIC, QUORUM):
            got = drain(lc, victim, q)
            assert len(got) == len(set(got)), f"{q}: duplicates"
            assert set(got) == confirmed[q], (
                f"{q}: lost {sorted(confirmed[q] - set(got))[:10]}, unexpected {sorted(set(got) - confirmed[q])[:10]}"
            )
    ns, links = netns.leftovers()
    assert not [n for n in ns + links if n.startswith(lc.lab.name)], "the lab's teardown left names behind"
