"""RegistryClient: requests with ids, answers matched whatever their order.

One checker per guarantee of the module docstring: an answer is matched to
exactly one request, once; a foreign or unknown ref is not taken; an
unanswered request is given up after the timeout with its context."""

from __future__ import annotations

import random

import pytest

from mirrorq.node.messages import RegistryGet, RegistryResult, RegistryRows, RegistryTxn
from mirrorq.node.registry_client import RegistryClient


def test_answers_in_any_order_find_their_context():
    rng = random.Random(7)
    c = RegistryClient("m")
    reqs = []
    for i in range(200):
        if i % 2:
            r = c.get(0.0, "amqqueue", ["/", f"q{i}"], ("get", i))
            assert isinstance(r, RegistryGet) and r.key == ["/", f"q{i}"]
            reqs.append((i, RegistryRows(True, [], ref=r.ref)))
        else:
            r = c.txn(0.0, {"ops": []}, ("txn", i))
            assert isinstance(r, RegistryTxn)
            reqs.append((i, RegistryResult(True, ref=r.ref)))
    assert len(c) == 200
    rng.shuffle(reqs)
    for i, answer in reqs:
        assert c.answer(answer)[1] == i
    assert len(c) == 0


def test_an_answer_is_taken_once_and_foreign_refs_are_not_taken():
    c = RegistryClient("m")
    r = c.get(0.0, "node", None, "ctx")
    ans = RegistryRows(True, [{"name": "n1"}], ref=r.ref)
    assert c.answer(ans) == "ctx"
    assert c.answer(ans) is None  # a duplicate
    assert c.answer(RegistryRows(True, [], ref=("other", 1))) is None
    assert c.answer(RegistryRows(True, [])) is None  # no ref: someone else's
    assert c.answer(RegistryResult(True, ref=("m", 999))) is None


def test_unanswered_requests_expire_with_their_context_oldest_first():
    c = RegistryClient("m", timeout=5.0)
    a = c.get(0.0, "t", None, "a")
    c.get(1.0, "t", None, "b")
    c.get(4.0, "t", None, "c")
    assert c.expired(6.5) == ["a", "b"]
    assert list(c.pending()) == ["c"]
    assert c.answer(RegistryRows(True, [], ref=a.ref)) is None  # given up: a late answer is not taken
    assert c.expired(100.0) == ["c"]


@pytest.mark.parametrize(
    "kw, what",
    [({"tag": ""}, "tag"), ({"tag": "x", "timeout": 0}, "timeout"), ({"tag": "x", "timeout": True}, "timeout")],
)
def test_bad_arguments_are_named(kw, what):
    with pytest.raises(ValueError, match=what):
        RegistryClient(**kw)
