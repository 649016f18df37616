"""Server-side paging of GET /api/queues (mirrorq.mgmt.paging, issue #35):
RabbitMQ's ``page``, ``page_size``, ``name``, ``use_regex``, ``sort``,
``sort_reverse``, the page object's shape, 400s naming the parameter, and a
10k-queue listing of which only one page is serialized -- over the fake
source of test_mgmt_app (no cluster)."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp")

from test_mgmt_app import ADMIN, basic, run  # noqa: E402

from mirrorq.mgmt import api, paging  # noqa: E402

H = basic(*ADMIN)
PAGE_KEYS = {"items", "page", "page_count", "page_size", "total_count", "filtered_count", "item_count"}


def queue(i: int, messages: int | None = None, vhost: str = "/") -> dict:
    return {
        "name": f"q{i:05d}",
        "vhost": vhost,
        "messages": i % 7 if messages is None else messages,
        "message_stats": {"publish_details": {"rate": float(i % 11)}},
        "ring": [],
    }


def test_a_page_of_a_filtered_sorted_listing_has_rabbitmqs_shape():
    async def body(client, source):
        source.queue_list = [queue(i) for i in range(25)] + [{"name": "Orders.EU", "vhost": "/", "messages": 3}]
        r = await client.get("/api/queues?page=2&page_size=10", headers=H)
        assert r.status == 200
        p = await r.json()
        assert set(p) == PAGE_KEYS
        assert (p["page"], p["page_size"], p["page_count"], p["item_count"]) == (2, 10, 3, 10)
        assert (p["total_count"], p["filtered_count"]) == (26, 26)
        assert [q["name"] for q in p["items"]] == [f"q{i:05d}" for i in range(10, 20)]
        # the last page is short
        p = await (await client.get("/api/queues?page=3&page_size=10", headers=H)).json()
        assert p["item_count"] == 6 and p["items"][-1]["name"] == "Orders.EU"
        # name filter: a substring, any case
        p = await (await client.get("/api/queues?page=1&name=ORDERS", headers=H)).json()
        assert [q["name"] for q in p["items"]] == ["Orders.EU"]
        assert (p["total_count"], p["filtered_count"], p["page_count"], p["page_size"]) == (26, 1, 1, 100)
        # a regular expression, searched; a plain "." is only a dot without use_regex
        p = await (await client.get("/api/queues?page=1&name=q0001[0-2]$&use_regex=true", headers=H)).json()
        assert [q["name"] for q in p["items"]] == ["q00010", "q00011", "q00012"]
        p = await (await client.get("/api/queues?page=1&name=rd.r", headers=H)).json()
        assert p["filtered_count"] == 0 and p["items"] == [] and p["page_count"] == 0
        p = await (await client.get("/api/queues?page=1&name=rd.r&use_regex=true", headers=H)).json()
        assert [q["name"] for q in p["items"]] == ["Orders.EU"]
        # sort by a field, dotted into nested objects; reversed; ties keep the listing's order
        p = await (await client.get("/api/queues?page=1&page_size=5&sort=messages&sort_reverse=true", headers=H)).json()
        assert [q["messages"] for q in p["items"]] == [6, 6, 6, 5, 5]
        assert [q["name"] for q in p["items"]][:3] == ["q00006", "q00013", "q00020"]
        p = await (
            await client.get("/api/queues?page=1&page_size=3&sort=message_stats.publish_details.rate", headers=H)
        ).json()
        # Orders.EU has no message_stats: missing sorts first
        assert [q["name"] for q in p["items"]] == ["Orders.EU", "q00000", "q00011"]
        # without page: the sort and the filter, as a plain list
        r = await client.get("/api/queues?name=q0002&sort=name&sort_reverse=true", headers=H)
        assert [q["name"] for q in await r.json()] == [f"q{i:05d}" for i in range(24, 19, -1)]
        # the vhost listing pages too
        r = await client.get("/api/queues/%2F?page=1&page_size=1", headers=H)
        p = await r.json()
        assert p["item_count"] == 1 and p["page_count"] == 26 and source.calls[-1] == ("queues", "/")

    run(body)


@pytest.mark.parametrize(
    "query, param",
    [
        ("page=0", "page"),
        ("page=x", "page"),
        ("page=4&page_size=10", "page"),  # 26 queues: 3 pages
        ("page=1&page_size=0", "page_size"),
        ("page=1&page_size=501", "page_size"),
        ("page=1&page_size=ten", "page_size"),
        ("page_size=1000", "page_size"),  # checked without page too
        ("page=1&name=(&use_regex=true", "name"),
        ("page=1&use_regex=maybe", "use_regex"),
        ("page=1&sort_reverse=2", "sort_reverse"),
        ("page=1&sort=", "sort"),
        ("page=1&sort=message_stats..rate", "sort"),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(query, param):
    async def body(client, source):
        source.queue_list = [queue(i) for i in range(26)]
        r = await client.get(f"/api/queues?{query}", headers=H)
        assert r.status == 400
        answer = await r.json()
        assert answer["error"] == "bad_request" and answer["reason"].startswith(f"{param}: "), answer

    source, _ = run(body)
    if param != "page" or "page=4" not in query:
        # refused before the cluster is asked (only a page past the end needs the count)
        assert not source.calls


def test_ten_thousand_queues_answer_one_page_serialized(monkeypatch):
    serialized: list = []
    real = api._dumps

    def counting(value):
        serialized.append(value)
        return real(value)

    monkeypatch.setattr(api, "_dumps", counting)

    async def body(client, source):
        source.queue_list = [queue(i, messages=(i * 7919) % 10_000) for i in range(10_000)]
        r = await client.get("/api/queues?page=3&page_size=500&sort=messages&sort_reverse=true", headers=H)
        assert r.status == 200
        p = await r.json()
        assert (p["total_count"], p["filtered_count"], p["page_count"], p["item_count"]) == (10_000, 10_000, 20, 500)
        assert [q["messages"] for q in p["items"]] == list(range(10_000 - 1000 - 1, 10_000 - 1500 - 1, -1))
        assert source.calls == [("queues", None)]  # one listing from the source

    run(body)
    assert len(serialized) == 1 and len(serialized[0]["items"]) == 500
    # the one value serialized holds the page's queue objects only
    assert all(
        type(q) is dict and set(q) == {"name", "vhost", "messages", "message_stats", "ring"}
        for q in serialized[0]["items"]
    )


def test_parse_and_select_pure():
    assert paging.parse({}) == paging.ListQuery()
    q = paging.parse({"page": "2", "page_size": "3", "sort": "a.b", "sort_reverse": "TRUE", "name": "x"})
    assert q == paging.ListQuery(2, 3, "x", False, ("a", "b"), True) and q.paged
    items = [{"name": f"x{i}", "a": {"b": i % 4}} for i in range(8)] + [{"name": "y", "a": {"b": 9}}]
    p = paging.select(items, q)
    assert [o["name"] for o in p.items] == ["x6", "x1", "x5"]  # b sorted down: 3 3 2 | 2 1 1 | 0 0: page 2
    assert (p.page_count, p.total_count, p.filtered_count) == (3, 9, 8)
    # an unpaged select is page 1; an empty list has page 1 of 0
    empty = paging.select([], paging.ListQuery())
    assert (empty.page, empty.page_count, empty.items) == (1, 0, [])
    with pytest.raises(paging.BadParameter) as e:
        paging.select([], paging.ListQuery(page=2))
    assert e.value.param == "page"
