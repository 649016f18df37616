"""The multi-host lab's names and addresses (no namespace is made here)."""

from __future__ import annotations

from mirrorq.admin.netns import IFNAME_MAX, NetLab


def test_lab_names_fit_interfaces_and_addresses_are_private():
    lab = NetLab(12)
    lab.subnet = 0
    lab.octets = {i: 10 + i for i in range(1, 13)}
    assert lab.name.startswith("mqh") and len(lab.veth(12)) <= IFNAME_MAX and len(lab.bridge) <= IFNAME_MAX
    assert lab.gateway == "10.77.0.1" and lab.address(3) == "10.77.0.13"
    assert lab.ns(1) != lab.ns(2) and all(lab.name in x for x in (lab.ns(1), lab.veth(1), lab.bridge))
    assert NetLab(1).name != NetLab(1).name  # two labs of one process never share names
