"""Pattern matching (re:run search semantics), apply-to, vhosts, priority and ties."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrorq.policy.matching import effective_definition, match, match_all, matches
from mirrorq.policy.records import Policy

ALL = {"ha-mode": "all"}


def P(name, pattern=".*", priority=0, apply_to="all", vhost="/", definition=None):
    return Policy(vhost, name, pattern, definition or ALL, priority, apply_to)


# -------------------------------------------------------------- patterns


@pytest.mark.parametrize(
    "pattern,name,expected",
    [
        ("ha", "orders.ha.1", True),  # a search, not a full match
        ("^ha", "orders.ha.1", False),
        ("^hello", "hello-world", True),  # the seed's example
        ("^hello", "say-hello", False),
        ("1$", "orders.ha.1", True),
        ("^orders\\.ha$", "orders.ha.1", False),
        (".*", "", True),
        ("", "anything", True),  # empty pattern matches everything
        ("^$", "", True),
        ("a|b", "xbx", True),
        ("^(x|y)\\.", "z.q", False),
    ],
)
def test_pattern_is_searched_anywhere_unless_anchored(pattern, name, expected):
    assert matches(P("p", pattern), "/", name) is expected


def test_vhost_must_be_equal():
    p = P("p", vhost="vh1")
    assert matches(p, "vh1", "q")
    assert not matches(p, "vh2", "q")
    assert not matches(p, "/", "q")


@pytest.mark.parametrize(
    "apply_to,kind,expected",
    [
        ("queues", "queue", True),
        ("queues", "exchange", False),
        ("exchanges", "exchange", True),
        ("exchanges", "queue", False),
        ("all", "queue", True),
        ("all", "exchange", True),
    ],
)
def test_apply_to(apply_to, kind, expected):
    assert matches(P("p", apply_to=apply_to), "/", "x", kind) is expected


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="kind"):
        matches(P("p"), "/", "x", "binding")
    with pytest.raises(ValueError, match="kind"):
        match([], "/", "x", "queues")
    with pytest.raises(ValueError, match="kind"):
        match_all([], "/", "x", "stream")


# -------------------------------------------------------------- priority


def test_highest_priority_wins_in_any_order():
    low = P("a-low", priority=1)
    high = P("z-high", priority=10)
    mid = P("m-mid", priority=5)
    for order in itertools.permutations([low, high, mid]):
        assert match(order, "/", "q") is high
        assert match_all(order, "/", "q") == [high, mid, low]


def test_non_matching_higher_priority_is_ignored():
    broad = P("broad", ".*", priority=0)
    narrow = P("narrow", "^special", priority=9)
    other_vhost = P("elsewhere", ".*", priority=99, vhost="other")
    exchanges_only = P("xs", ".*", priority=50, apply_to="exchanges")
    policies = [broad, narrow, other_vhost, exchanges_only]
    assert match(policies, "/", "plain") is broad
    assert match(policies, "/", "special.q") is narrow
    assert match(policies, "other", "plain") is other_vhost
    assert match(policies, "/", "plain", "exchange") is exchanges_only


def test_negative_priorities_order():
    a = P("a", priority=-5)
    b = P("b", priority=-1)
    assert match([a, b], "/", "q") is b


def test_ties_go_to_the_name_that_sorts_first_whatever_the_listing_order():
    # RabbitMQ leaves equal priorities "undeterministic"; we fix: name ascending, first wins
    ps = [P("beta", priority=3), P("alpha", priority=3), P("gamma", priority=3), P("omega", priority=1)]
    for order in itertools.permutations(ps):
        assert match(order, "/", "q").name == "alpha"
        assert [p.name for p in match_all(order, "/", "q")] == ["alpha", "beta", "gamma", "omega"]


def test_tie_order_is_code_point_order():
    # "Z" (0x5A) sorts before "a" (0x61); "é" after "z"; same as Erlang's byte order of UTF-8
    assert match([P("a"), P("Z")], "/", "q").name == "Z"
    assert match([P("é"), P("z")], "/", "q").name == "z"


def test_no_match_gives_none():
    assert match([P("p", "^x")], "/", "y") is None
    assert match([], "/", "y") is None
    assert match_all([P("p", "^x")], "/", "y") == []


# ---------------------------------------------------- effective definition


def test_effective_definition_is_the_winners_definition():
    exactly = {"ha-mode": "exactly", "ha-params": 2}
    nodes = {"ha-mode": "nodes", "ha-params": ["n1", "n2"], "ha-sync-mode": "automatic"}
    ps = [
        P("all", ".*", 0),
        P("two", "^two", 1, definition=exactly),
        P("pinned", "^two\\.pinned", 2, definition=nodes),
        P("xchg", ".*", 100, apply_to="exchanges", definition={"ha-mode": "all"}),
    ]
    assert effective_definition(ps, "/", "q") == ALL
    assert effective_definition(ps, "/", "two.q") == exactly
    assert effective_definition(ps, "/", "two.pinned") == nodes
    assert effective_definition(ps, "elsewhere", "q") is None
    # a plain dict copy: callers can't alter the record through it
    d = effective_definition(ps, "/", "two.pinned")
    assert type(d) is dict and type(d["ha-params"]) is list
    d["ha-params"].append("n3")
    assert effective_definition(ps, "/", "two.pinned") == nodes


# ------------------------------------------------------------ property

policy_strategy = st.builds(
    P,
    name=st.text(alphabet="abcAB", min_size=1, max_size=3),
    pattern=st.sampled_from(["", "a", "^a", "b$", "^ab", "a.*b", "^$", "c"]),
    priority=st.integers(-2, 2),
    apply_to=st.sampled_from(["queues", "exchanges", "all"]),
    vhost=st.sampled_from(["/", "v"]),
)


@settings(max_examples=150, deadline=None)
@given(
    policies=st.lists(policy_strategy, max_size=8, unique_by=lambda p: (p.vhost, p.name)),
    name=st.text(alphabet="abc", max_size=4),
    vhost=st.sampled_from(["/", "v"]),
    kind=st.sampled_from(["queue", "exchange"]),
    data=st.data(),
)
def test_winner_property(policies, name, vhost, kind, data):
    shuffled = data.draw(st.permutations(policies))
    winner = match(policies, vhost, name, kind)
    assert match(shuffled, vhost, name, kind) == winner  # listing order never matters
    candidates = [
        p
        for p in policies
        if p.vhost == vhost and (p.apply_to == "all" or p.apply_to == kind + "s") and re.search(p.pattern, name)
    ]
    if not candidates:
        assert winner is None
        return
    top = max(p.priority for p in candidates)
    assert winner.priority == top
    assert winner.name == min(p.name for p in candidates if p.priority == top)
    ranked = match_all(shuffled, vhost, name, kind)
    assert ranked[0] == winner and set(ranked) == set(candidates)
    assert [p.priority for p in ranked] == sorted((p.priority for p in ranked), reverse=True)
