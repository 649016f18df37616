"""Policy records and the validation rules of ``set_policy`` (RabbitMQ's, plus ours)."""

from __future__ import annotations

import dataclasses
import pickle

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrorq.policy.records import (
    DEFINITION_KEYS,
    Definition,
    Policy,
    PolicyValidationError,
    validate_definition,
)


def policy(**kw):
    args = dict(vhost="/", name="ha", pattern="^ha\\.", definition={"ha-mode": "all"})
    args.update(kw)
    return Policy(**args)


def rejects(definition, key, *fragments):
    """validate_definition refuses ``definition``, blaming ``key``, message mentioning fragments."""
    with pytest.raises(PolicyValidationError) as info:
        validate_definition(definition)
    assert info.value.key == key, str(info.value)
    msg = str(info.value)
    for fragment in (key, *fragments):
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    # the record constructor applies the same rule
    with pytest.raises(PolicyValidationError):
        policy(definition=definition)


# ---------------------------------------------------------------- valid input


@pytest.mark.parametrize(
    "definition",
    [
        {"ha-mode": "all"},
        {"ha-mode": "exactly", "ha-params": 1},
        {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"},
        {"ha-mode": "nodes", "ha-params": ["rabbit@a", "rabbit@b"]},
        {"ha-mode": "nodes", "ha-params": ["no-such-node"]},  # unknown names allowed
        {"queue-master-locator": "min-masters"},  # not an ha-* key: no ha-mode needed
        {
            "ha-mode": "exactly",
            "ha-params": 3,
            "ha-sync-mode": "manual",
            "ha-sync-batch-size": 1,
            "ha-promote-on-shutdown": "always",
            "ha-promote-on-failure": "when-synced",
            "ha-confirm-mode": "async",
            "ha-confirm-timeout": 250,
            "queue-master-locator": "random",
        },
    ],
)
def test_valid_definitions_are_accepted_unchanged(definition):
    out = validate_definition(definition)
    expected = dict(definition)
    if isinstance(expected.get("ha-params"), list):
        expected["ha-params"] = tuple(expected["ha-params"])
    assert out == expected
    assert policy(definition=definition).definition.to_dict() == definition


def test_seed_example_hello_ha():
    # rabbitmqctl set_policy hello-ha "^hello" '{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}'
    p = Policy("/", "hello-ha", "^hello", {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"})
    assert p.priority == 0 and p.apply_to == "all"
    assert p.definition["ha-params"] == 2


# --------------------------------------------------------- ha-mode presence


@pytest.mark.parametrize(
    "key,value",
    [
        ("ha-params", 2),
        ("ha-sync-mode", "automatic"),
        ("ha-sync-batch-size", 10),
        ("ha-promote-on-shutdown", "always"),
        ("ha-promote-on-failure", "always"),
        ("ha-confirm-mode", "sync"),
        ("ha-confirm-timeout", 100),
        ("ha-deliver-mode", "replicated"),
    ],
)
def test_ha_key_without_ha_mode_is_rejected(key, value):
    rejects({key: value}, "ha-mode", key, "must be specified")


def test_ha_mode_must_be_known():
    rejects({"ha-mode": "two"}, "ha-mode", "'two'", "'all'", "'exactly'", "'nodes'")
    rejects({"ha-mode": 2}, "ha-mode", "2")


# ------------------------------------------------------------ ha-params


def test_mode_all_takes_no_params():
    rejects({"ha-mode": "all", "ha-params": 2}, "ha-params", '"all"', "does not take")
    rejects({"ha-mode": "all", "ha-params": None}, "ha-params", "does not take")


@pytest.mark.parametrize("params", [0, -1, "2", 2.5, 2.0, True, [2], None])
def test_mode_exactly_needs_positive_integer(params):
    rejects({"ha-mode": "exactly", "ha-params": params}, "ha-params", '"exactly"', repr(params))


def test_mode_exactly_without_params():
    rejects({"ha-mode": "exactly"}, "ha-params", '"exactly"', "needs")


@pytest.mark.parametrize(
    "params,fragment",
    [
        ([], "non-empty"),
        ("rabbit@a", "list"),
        (3, "list"),
        ({"rabbit@a": 1}, "list"),
        (["rabbit@a", 3], "[3]"),
        (["rabbit@a", ""], "['']"),
    ],
)
def test_mode_nodes_needs_non_empty_list_of_strings(params, fragment):
    rejects({"ha-mode": "nodes", "ha-params": params}, "ha-params", '"nodes"', fragment)


def test_mode_nodes_without_params():
    rejects({"ha-mode": "nodes"}, "ha-params", '"nodes"', "needs")


# -------------------------------------------------------- the other keys


@pytest.mark.parametrize(
    "key,bad,allowed",
    [
        ("ha-sync-mode", "manually", ("'automatic'", "'manual'")),
        ("ha-sync-mode", "auto", ("'automatic'", "'manual'")),
        ("ha-promote-on-shutdown", "never", ("'when-synced'", "'always'")),
        ("ha-promote-on-failure", "sometimes", ("'always'", "'when-synced'")),
        ("ha-confirm-mode", "both", ("'sync'", "'async'")),
        ("ha-confirm-mode", True, ("'sync'", "'async'")),
        ("ha-deliver-mode", "sync", ("'immediate'", "'replicated'")),
    ],
)
def test_enumerated_ha_keys(key, bad, allowed):
    rejects({"ha-mode": "all", key: bad}, key, repr(bad), *allowed)


@pytest.mark.parametrize("good", ["automatic", "manual"])
def test_sync_modes_accepted(good):
    assert validate_definition({"ha-mode": "all", "ha-sync-mode": good})["ha-sync-mode"] == good


@pytest.mark.parametrize("key", ["ha-promote-on-shutdown", "ha-promote-on-failure"])
@pytest.mark.parametrize("good", ["always", "when-synced"])
def test_promote_values_accepted(key, good):
    assert validate_definition({"ha-mode": "all", key: good})[key] == good


@pytest.mark.parametrize("bad", [0, -5, "10", True, 1.5])
def test_sync_batch_size_must_be_positive_integer(bad):
    rejects({"ha-mode": "all", "ha-sync-batch-size": bad}, "ha-sync-batch-size", "> 0", repr(bad))


@pytest.mark.parametrize("bad", [0, -1, "100", 1.5, False])
def test_confirm_timeout_must_be_positive_milliseconds(bad):
    rejects({"ha-mode": "all", "ha-confirm-timeout": bad}, "ha-confirm-timeout", "milliseconds", repr(bad))


@pytest.mark.parametrize("bad", ["balanced", "client_local", 1])
def test_queue_master_locator(bad):
    rejects(
        {"queue-master-locator": bad}, "queue-master-locator", "'min-masters'", "'client-local'", "'random'", repr(bad)
    )


@pytest.mark.parametrize("good", ["min-masters", "client-local", "random"])
def test_queue_master_locator_accepted(good):
    assert validate_definition({"queue-master-locator": good}) == {"queue-master-locator": good}


# ----------------------------------------------- shape of the definition


def test_unknown_key_is_rejected_by_name():
    rejects({"ha-mode": "all", "message-ttl": 1000}, "message-ttl", "not a recognised")
    rejects({"ha-mdoe": "all"}, "ha-mdoe", "not a recognised")


def test_several_unknown_keys_are_all_named():
    with pytest.raises(PolicyValidationError) as info:
        validate_definition({"x-a": 1, "x-b": 2, "ha-mode": "all"})
    assert "'x-a'" in str(info.value) and "'x-b'" in str(info.value)


def test_empty_and_non_mapping_definitions():
    rejects({}, "definition", "no policy provided")
    rejects([("ha-mode", "all")], "definition", "dictionary")
    rejects('{"ha-mode": "all"}', "definition", "dictionary")
    rejects({1: "all"}, "definition", "strings")


def test_first_broken_rule_is_reported():
    # ha-mode presence is checked before the values of other keys
    rejects({"ha-sync-mode": "bogus"}, "ha-mode")
    # an invalid mode is reported before its params
    rejects({"ha-mode": "some", "ha-params": "x"}, "ha-mode")


# -------------------------------------------------------- record fields


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("vhost", "", "vhost"),
        ("vhost", None, "vhost"),
        ("name", "", "name"),
        ("name", 7, "name"),
        ("pattern", "(unclosed", "not a valid regular expression"),
        ("pattern", "[z-a]", "not a valid regular expression"),
        ("pattern", 5, "pattern"),
        ("priority", "1", "integer"),
        ("priority", 1.5, "integer"),
        ("priority", True, "integer"),
        ("apply_to", "both", "'queues'"),
        ("apply_to", "queue", "'exchanges'"),
    ],
)
def test_bad_record_fields(field, value, fragment):
    with pytest.raises(PolicyValidationError) as info:
        policy(**{field: value})
    assert fragment in str(info.value)
    assert info.value.key == {"apply_to": "apply-to"}.get(field, field)


def test_invalid_regex_names_the_pattern():
    with pytest.raises(PolicyValidationError) as info:
        policy(pattern="a(b")
    assert "'a(b'" in str(info.value)


@pytest.mark.parametrize("apply_to", ["queues", "exchanges", "all"])
def test_apply_to_values(apply_to):
    assert policy(apply_to=apply_to).apply_to == apply_to


def test_negative_priority_allowed():
    assert policy(priority=-3).priority == -3


# ------------------------------------------------- immutability, dict form


def test_record_is_frozen_and_definition_read_only():
    p = policy(definition={"ha-mode": "nodes", "ha-params": ["a", "b"]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.priority = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.definition["ha-mode"] = "all"  # type: ignore[index]
    assert p.definition["ha-params"] == ("a", "b")
    # mutating what to_dict returned does not touch the record
    d = p.to_dict()
    d["definition"]["ha-params"].append("c")
    assert p.definition["ha-params"] == ("a", "b")


def test_caller_mutation_after_construction_does_not_leak_in():
    source = {"ha-mode": "nodes", "ha-params": ["a"]}
    p = policy(definition=source)
    source["ha-params"].append("b")
    source["ha-mode"] = "all"
    assert p.definition.to_dict() == {"ha-mode": "nodes", "ha-params": ["a"]}


def test_to_dict_is_plain_and_msgpack_round_trips():
    p = Policy(
        "vh",
        "mirror-two",
        "^q\\.",
        {"ha-mode": "nodes", "ha-params": ["n1", "n2"], "ha-sync-mode": "automatic"},
        priority=4,
        apply_to="queues",
    )
    d = p.to_dict()
    assert d == {
        "vhost": "vh",
        "name": "mirror-two",
        "pattern": "^q\\.",
        "definition": {"ha-mode": "nodes", "ha-params": ["n1", "n2"], "ha-sync-mode": "automatic"},
        "priority": 4,
        "apply_to": "queues",
    }
    wire = msgpack.unpackb(msgpack.packb(d), raw=False)
    assert Policy.from_dict(wire) == p
    assert hash(Policy.from_dict(wire)) == hash(p)


def test_from_dict_defaults_and_errors():
    p = Policy.from_dict({"vhost": "/", "name": "n", "pattern": ".*", "definition": {"ha-mode": "all"}})
    assert p.priority == 0 and p.apply_to == "all"
    with pytest.raises(PolicyValidationError) as info:
        Policy.from_dict({"vhost": "/", "name": "n", "definition": {"ha-mode": "all"}})
    assert info.value.key == "pattern" and "missing" in str(info.value)
    with pytest.raises(PolicyValidationError) as info:
        Policy.from_dict(
            {"vhost": "/", "name": "n", "pattern": ".", "definition": {"ha-mode": "all"}, "applyto": "queues"}
        )
    assert info.value.key == "applyto" and "unknown" in str(info.value)
    # RabbitMQ's spelling from a JSON export is accepted too, but not both at once
    rabbit = Policy.from_dict(
        {"vhost": "/", "name": "n", "pattern": ".", "definition": {"ha-mode": "all"}, "apply-to": "exchanges"}
    )
    assert rabbit.apply_to == "exchanges" and rabbit.to_dict()["apply_to"] == "exchanges"
    with pytest.raises(PolicyValidationError, match="not both"):
        Policy.from_dict(
            {
                "vhost": "/",
                "name": "n",
                "pattern": ".",
                "definition": {"ha-mode": "all"},
                "apply-to": "queues",
                "apply_to": "queues",
            }
        )
    with pytest.raises(PolicyValidationError):
        Policy.from_dict(["not", "a", "dict"])
    with pytest.raises(PolicyValidationError) as info:
        Policy.from_dict(
            {"vhost": "/", "name": "n", "pattern": ".", "definition": {"ha-mode": "exactly", "ha-params": 0}}
        )
    assert info.value.key == "ha-params"


def test_pickle_round_trip_keeps_compiled_pattern():
    p = policy(definition={"ha-mode": "nodes", "ha-params": ["a"]})
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.regex.search("ha.x") and not q.regex.search("xha")
    assert pickle.loads(pickle.dumps(p.definition)) == p.definition


def test_definition_equality_ignores_list_vs_tuple():
    a = Definition({"ha-mode": "nodes", "ha-params": ["a", "b"]})
    assert a == {"ha-mode": "nodes", "ha-params": ["a", "b"]}
    assert a != {"ha-mode": "nodes", "ha-params": ["b", "a"]}
    assert a != {"bogus": 1}
    assert len({a, Definition({"ha-mode": "nodes", "ha-params": ("a", "b")})}) == 1


# ------------------------------------------------------- property: round trip

node_names = st.text(alphabet="abcdefgh@.-_0123456789", min_size=1, max_size=8)
ha_core = st.one_of(
    st.just({"ha-mode": "all"}),
    st.integers(1, 9).map(lambda n: {"ha-mode": "exactly", "ha-params": n}),
    st.lists(node_names, min_size=1, max_size=4).map(lambda ns: {"ha-mode": "nodes", "ha-params": ns}),
)
extras = st.fixed_dictionaries(
    {},
    optional={
        "ha-sync-mode": st.sampled_from(["automatic", "manual"]),
        "ha-sync-batch-size": st.integers(1, 10_000),
        "ha-promote-on-shutdown": st.sampled_from(["always", "when-synced"]),
        "ha-promote-on-failure": st.sampled_from(["always", "when-synced"]),
        "ha-confirm-mode": st.sampled_from(["sync", "async"]),
        "ha-confirm-timeout": st.integers(1, 60_000),
        "queue-master-locator": st.sampled_from(["min-masters", "client-local", "random"]),
    },
)
definitions = st.builds(lambda core, ex: {**core, **ex}, ha_core, extras)


@settings(max_examples=60, deadline=None)
@given(
    vhost=st.text(min_size=1, max_size=6),
    name=st.text(min_size=1, max_size=6),
    pattern=st.sampled_from([".*", "^a", "b$", "a|b", "^(x|y)\\.", ""]),
    definition=definitions,
    priority=st.integers(-10, 10),
    apply_to=st.sampled_from(["queues", "exchanges", "all"]),
)
def test_round_trip_property(vhost, name, pattern, definition, priority, apply_to):
    p = Policy(vhost, name, pattern, definition, priority, apply_to)
    d = p.to_dict()
    assert set(d["definition"]) <= set(DEFINITION_KEYS)
    assert Policy.from_dict(msgpack.unpackb(msgpack.packb(d), raw=False)) == p
    assert d["definition"] == definition
