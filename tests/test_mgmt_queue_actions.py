"""A queue's actions in the management API (issue #35, for the console's
queue page): purge (``DELETE /api/queues/{vhost}/{name}/contents``) and
``POST /api/queues/{vhost}/{name}/actions`` with ``sync`` / ``cancel_sync``,
as RabbitMQ's API -- over the fake source of test_mgmt_app (no cluster;
tests/cluster/test_mgmt_cluster.py runs them on a real one)."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp")

from test_mgmt_app import ADMIN, PLAIN, basic, run  # noqa: E402

H = basic(*ADMIN)


def test_purge_is_a_204_and_an_unknown_queue_a_404():
    async def body(client, source):
        r = await client.delete("/api/queues/my%2Fvhost/q1/contents", headers=H)
        assert r.status == 204 and source.calls[-1] == ("purge_queue", "my/vhost", "q1")
        r = await client.delete("/api/queues/%2F/nope/contents", headers=H)
        assert r.status == 404 and (await r.json())["reason"] == "no queue 'nope' in vhost '/'"
        r = await client.delete("/api/queues/%2F/q1/contents", headers=basic(*PLAIN))
        assert r.status == 403

    run(body)


def test_sync_and_cancel_sync_actions_and_anything_else_a_400_naming_action():
    async def body(client, source):
        for action in ("sync", "cancel_sync"):
            r = await client.post("/api/queues/%2F/q1/actions", json={"action": action}, headers=H)
            assert r.status == 204 and source.calls[-1] == ("queue_action", "/", "q1", action)
        asked = len(source.calls)
        for bad in ({"action": "resync"}, {}, {"action": ["sync"]}):
            r = await client.post("/api/queues/%2F/q1/actions", json=bad, headers=H)
            answer = await r.json()
            assert r.status == 400 and answer["reason"].startswith("action: must be one of sync, cancel_sync"), answer
        r = await client.post("/api/queues/%2F/q1/actions", data=b"sync", headers=H)
        assert r.status == 400 and "not JSON" in (await r.json())["reason"]
        assert len(source.calls) == asked  # refused before the queue is asked
        r = await client.get("/api/queues/%2F/q1/actions", headers=H)
        assert r.status == 405

    run(body)
