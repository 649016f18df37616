"""The multi-host lab on the real kernel: namespaces on a bridge with their
own addresses, netem delay per link (measured; on a kernel without netem,
the lab's error saying so), an address move, teardown
that removes exactly what the lab made, and a stale-leftover cleanup that
removes only labs whose creator is dead.  Needs root and ``ip netns``: it
fails, naming what is missing, without them."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from mirrorq.admin import netns
from mirrorq.admin.cluster import poll

pytestmark = pytest.mark.cluster


@pytest.fixture(autouse=True)
def _needs_netns():
    why = netns.unavailable()
    if why:
        pytest.fail(f"the lab needs network namespaces (root, iproute2): {why}")


def _names(lab: netns.NetLab) -> set[str]:
    ns, links = netns.leftovers()
    return {n for n in ns + links if n.startswith(lab.name)}


def _connect_ms(host: str, port: int) -> float:
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=5):
        return (time.perf_counter() - t0) * 1000


def test_addresses_delay_move_and_teardown():
    lab = netns.NetLab(2)
    with lab:
        assert _names(lab) == {lab.ns(1), lab.ns(2), lab.veth(1), lab.veth(2), lab.bridge}
        assert lab.address(1) != lab.address(2) and lab.network.is_private
        listener = lab.spawn(
            1,
            [
                sys.executable,
                "-c",
                f"import socket,time; s=socket.create_server(({lab.address(1)!r}, 15000)); "
                "print('ok', flush=True); [s.accept() for _ in range(100)]",
            ],
            stdout=subprocess.PIPE,
        )
        assert listener.stdout is not None and listener.stdout.readline().strip() == b"ok"
        base = min(_connect_ms(lab.address(1), 15000) for _ in range(3))
        try:
            lab.set_link(1, delay_ms=20)
        except netns.NetemUnavailable as e:
            # a kernel without sch_netem: the lab says so plainly (and keeps working without delay)
            assert "CONFIG_NET_SCH_NETEM" in str(e)
            assert _connect_ms(lab.address(1), 15000) < 20
        else:
            delayed = min(_connect_ms(lab.address(1), 15000) for _ in range(3))
            # a connect is one round trip: 20 ms toward the node and 20 ms back
            assert delayed >= 38 and delayed > base + 30, (base, delayed)
            lab.set_link(1)
            assert min(_connect_ms(lab.address(1), 15000) for _ in range(3)) < 20
        old = lab.address(2)
        new = lab.move(2)
        out = subprocess.run(["ip", "-n", lab.ns(2), "-4", "addr", "show", "eth0"], capture_output=True, text=True)
        assert new in out.stdout and old not in out.stdout
        pid = listener.pid
    assert not _names(lab)
    assert not netns._group_alive(pid)  # the teardown killed what the lab started
    listener.wait(5)


def test_cleanup_removes_only_labs_whose_creator_is_dead():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = netns.NetLab(1, name=f"{netns.FAMILY}{dead.pid}z")
    live = netns.NetLab(1)
    try:
        stale.create()
        live.create()
        gone = netns.cleanup_stale()
        assert set(gone) == {stale.ns(1), stale.veth(1), stale.bridge}
        assert poll(lambda: not _names(stale), 5)
        assert _names(live) == {live.ns(1), live.veth(1), live.bridge}
    finally:
        stale.teardown()
        live.teardown()
    assert not _names(live)
