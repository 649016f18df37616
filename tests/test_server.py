"""mirrorq-server's checks before anything starts: a bad config file is one
line naming the file and the key, exit 78 (EX_CONFIG), nothing started;
``--check`` loads a good one; a wildcard host is refused."""

from __future__ import annotations

import pytest

from mirrorq import server
from mirrorq.node.config import ConfigError, from_mapping


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("name: n1\nhost: 0.0.0.0\n", "host"),
        ("name: n1\namqp_port: 70000\n", "amqp_port"),
        ("name: n1\nseeds: [nohostport]\n", "seeds"),
        ("name: n1\nbind: 10.0.0.1\n", "bind"),
        ("host: 10.0.0.1\n", "name"),
    ],
)
def test_bad_config_names_the_key_and_exits_78(tmp_path, capsys, text, key):
    path = tmp_path / "node.yaml"
    path.write_text(text)
    assert server.main(["--config", str(path)]) == server.EX_CONFIG
    err = capsys.readouterr().err.strip()
    assert err.startswith("mirrorq-server: config error in ") and str(path) in err
    assert f"key '{key}'" in err and len(err.splitlines()) == 1


def test_missing_file_is_a_config_error(tmp_path, capsys):
    assert server.main(["--config", str(tmp_path / "nope.yaml")]) == server.EX_CONFIG
    assert "cannot read" in capsys.readouterr().err


def test_check_accepts_a_good_config(tmp_path, capsys):
    path = tmp_path / "node.yaml"
    path.write_text(
        "name: node2\nhost: 10.0.0.2\nseeds: ['10.0.0.1:19500', '10.0.0.3:19500']\n"
        "cluster_nodes: [node1, node2, node3]\nsecret_file: /etc/mirrorq/cluster.secret\n"
        f"data_dir: {tmp_path / 'data'}\n"
    )
    assert server.main(["--config", str(path), "--check"]) == 0
    assert "node node2 on 10.0.0.2" in capsys.readouterr().out
    assert not (tmp_path / "data").exists()  # checked, nothing started


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_a_wildcard_host_is_refused(wildcard):
    with pytest.raises(ConfigError) as e:
        from_mapping({"name": "n1", "host": wildcard})
    assert e.value.key == "host" and "wildcard" in str(e.value)
