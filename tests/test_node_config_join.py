"""node.yaml's cluster_nodes: a node not in the list joins an existing cluster."""

import pytest

from mirrorq.node.config import ConfigError, from_mapping


def test_member_of_initial_voters_does_not_join():
    cfg = from_mapping({"name": "n1", "cluster_nodes": ["n1", "n2", "n3"]})
    assert not cfg.joins
    assert not from_mapping({"name": "solo"}).joins  # no list: a one-node registry of its own


def test_node_outside_initial_voters_joins_and_needs_seeds():
    cfg = from_mapping({"name": "n4", "cluster_nodes": ["n1", "n2", "n3"], "seeds": ["127.0.0.1:19500"]})
    assert cfg.joins and cfg.cluster_nodes == ("n1", "n2", "n3")
    with pytest.raises(ConfigError) as e:
        from_mapping({"name": "n4", "cluster_nodes": ["n1", "n2"]}, "node.yaml")
    assert e.value.key == "cluster_nodes" and "needs seeds" in str(e.value)


@pytest.mark.parametrize("bad", [["n1", "n1"], "n1", [1], ["bad name"]])
def test_bad_cluster_nodes_are_named(bad):
    with pytest.raises(ConfigError) as e:
        from_mapping({"name": "n1", "cluster_nodes": bad, "seeds": ["h:1"]}, "node.yaml")
    assert e.value.key == "cluster_nodes"
