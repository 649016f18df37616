"""Routing rules and credentials of the AMQP topology cache."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrorq.amqp.topology import Topology, check_password, hash_password, topic_matches


@pytest.mark.parametrize(
    "pattern,key,want",
    [
        ("#", "", True),
        ("#", "a.b", True),
        ("*", "", False),
        ("*", "a", True),
        ("a.*", "a", False),
        ("a.#", "a", True),
        ("a.#.z", "a.z", True),
        ("a.#.z", "a.b.c.z", True),
        ("a.#.z", "a.b", False),
        ("*.b.#", "x.b", True),
        ("a.b", "a.b", True),
        ("a.b", "a.bb", False),
        ("", "", True),
        ("", "a", False),
    ],
)
def test_topic_rule(pattern, key, want):
    assert topic_matches(pattern, key) is want


def _reference(pattern: str, key: str) -> bool:
    # brute force over the word lists
    p, k = (pattern.split(".") if pattern else []), (key.split(".") if key else [])

    def m(i, j):
        if i == len(p):
            return j == len(k)
        if p[i] == "#":
            return any(m(i + 1, jj) for jj in range(j, len(k) + 1))
        return j < len(k) and (p[i] in ("*", k[j])) and m(i + 1, j + 1)

    return m(0, 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "*", "#"]), max_size=5), st.lists(st.sampled_from(["a", "b"]), max_size=5))
def test_topic_rule_matches_brute_force(pw, kw):
    assert topic_matches(".".join(pw), ".".join(kw)) == _reference(".".join(pw), ".".join(kw))


def test_passwords_are_salted_and_checked():
    h1, h2 = hash_password("pw"), hash_password("pw")
    assert h1 != h2 and check_password("pw", h1) and check_password("pw", h2)
    assert not check_password("PW", h1) and not check_password("pw", "garbage")


def test_authentication_and_permissions():
    t = Topology()
    assert t.authenticate("guest", "guest", loopback=True) is None
    assert "localhost" in t.authenticate("guest", "guest", loopback=False)
    assert "invalid credentials" in t.authenticate("bob", "x", loopback=True)
    t.put("user", {"name": "bob", "password_hash": hash_password("pw"), "tags": []})
    t.put("permission", {"user": "bob", "vhost": "/", "configure": "", "write": "^out", "read": ".*"})
    assert t.authenticate("bob", "pw", loopback=False) is None
    assert not t.allowed("bob", "/", "configure", "anything")  # empty regex: nothing
    assert t.allowed("bob", "/", "write", "outbox") and not t.allowed("bob", "/", "write", "inbox")
    assert t.allowed("bob", "/", "read", "") and not t.allowed("bob", "v2", "read", "q")


def test_changes_keep_the_cache_current():
    t = Topology()
    q = {"name": "q", "vhost": "/", "pid": "n1/h:1/u"}
    moved = t.apply([("amqqueue", ["/", "q"], None, q)])
    assert moved == [("/", "q", None, q)] and t.route("/", "", "q") == ["q"]
    t.apply([("amqqueue", ["/", "q"], q, None)])
    assert t.route("/", "", "q") == []
    with pytest.raises(ValueError, match="no table 'nope'"):
        t.load("nope", [])
