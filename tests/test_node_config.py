import pytest

from mirrorq.node.config import ConfigError, NodeConfig, from_mapping, load, parse_address


def test_defaults_and_round_trip(tmp_path):
    cfg = from_mapping({"name": "n1"}, "x.yaml")
    assert (cfg.host, cfg.admin_port, cfg.amqp_port) == ("127.0.0.1", 19500, 5672)
    assert cfg.heartbeat_timeout < 2.0 and cfg.data_dir.endswith("n1")
    path = tmp_path / "n.yaml"
    cfg.dump(path)
    assert load(path) == cfg


def test_max_message_size_defaults_to_16_mib_and_round_trips(tmp_path):
    assert from_mapping({"name": "n"}).max_message_size == 16 << 20
    cfg = from_mapping({"name": "n", "max_message_size": 1 << 20})
    assert cfg.max_message_size == 1 << 20 and cfg.to_dict()["max_message_size"] == 1 << 20
    cfg.dump(tmp_path / "n.yaml")
    assert load(tmp_path / "n.yaml").max_message_size == 1 << 20


def test_management_port_is_the_amqp_port_plus_10000_unless_given():
    assert from_mapping({"name": "n"}).management_port == 15672  # RabbitMQ's
    assert from_mapping({"name": "n", "amqp_port": 5680}).management_port == 15680
    assert from_mapping({"name": "n", "amqp_port": 60000}).management_port == 0  # past 65535: none
    assert from_mapping({"name": "n", "management_port": 0}).management_port == 0  # turned off
    assert from_mapping({"name": "n", "management_port": 18080}).management_port == 18080


@pytest.mark.parametrize(
    "raw, key, text",
    [
        ({}, "name", "missing"),
        ({"name": "bad name"}, "name", "letters, digits"),
        ({"name": "n", "colour": 1}, "colour", "unknown key"),
        ({"name": "n", "admin_port": "80"}, "admin_port", "port number"),
        ({"name": "n", "amqp_port": 0}, "amqp_port", "port number"),
        ({"name": "n", "amqp_port": 19500}, "amqp_port", "must differ from admin_port"),
        ({"name": "n", "seeds": "a:1"}, "seeds", "list of host:port"),
        ({"name": "n", "seeds": ["nohost"]}, "seeds", "not host:port"),
        ({"name": "n", "heartbeat_interval": -1}, "heartbeat_interval", "positive"),
        ({"name": "n", "heartbeat_timeout": True}, "heartbeat_timeout", "positive"),
        ({"name": "n", "heartbeat_interval": 1, "heartbeat_timeout": 1.5}, "heartbeat_timeout", "twice"),
        ({"name": "n", "management_port": "15672"}, "management_port", "port number"),
        ({"name": "n", "management_port": True}, "management_port", "port number"),
        ({"name": "n", "management_port": 5672}, "management_port", "must differ"),
        ({"name": "n", "max_message_size": 0}, "max_message_size", "from 1 to 33554432"),
        ({"name": "n", "max_message_size": (32 << 20) + 1}, "max_message_size", "32 MiB"),
        ({"name": "n", "max_message_size": "16MB"}, "max_message_size", "number of bytes"),
        ({"name": "n", "max_message_size": True}, "max_message_size", "number of bytes"),
    ],
)
def test_each_bad_key_is_named(raw, key, text):
    with pytest.raises(ConfigError) as e:
        from_mapping(raw, "node.yaml")
    assert e.value.key == key
    assert str(e.value).startswith(f"config error in node.yaml: key '{key}': ")
    assert text in str(e.value)


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [x\n")
    with pytest.raises(ConfigError, match=r"malformed YAML at line 2"):
        load(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "absent.yaml")
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load(lst)


def test_parse_address():
    assert parse_address("127.0.0.1:5672") == ("127.0.0.1", 5672)
    for bad in ("127.0.0.1", ":1", "h:x", "h:0", "h:70000"):
        with pytest.raises(ValueError):
            parse_address(bad)
    assert isinstance(NodeConfig("n").admin_address, str)
