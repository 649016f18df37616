"""The console pages' routes (mirrorq.mgmt.page, issue #35) over the fake
source of test_mgmt_app: /overview and /queues are served (auth as the
API), load their modules from /static/, and every page links the others;
tests/cluster/test_mgmt_console_browser.py runs them in a browser."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("aiohttp")

from test_mgmt_app import ADMIN, PLAIN, basic, run  # noqa: E402

from mirrorq.mgmt.page import STATIC  # noqa: E402


def test_console_pages_are_served_with_their_modules_and_link_each_other():
    async def body(client, source):
        h = basic(*ADMIN)
        for path, script in (("/overview", "overview.js"), ("/queues", "queues.js"), ("/queue", "queue.js")):
            r = await client.get(path)
            assert r.status == 401
            r = await client.get(path, headers=basic(*PLAIN))
            assert r.status == 403
            r = await client.get(path, headers=h)
            assert r.status == 200 and r.content_type == "text/html" and r.headers["Cache-Control"] == "no-cache"
            html = await r.text()
            assert f'<script type="module" src="static/{script}"></script>' in html
            links = set(re.findall(r'<a href="([^"]+)"', html))
            assert links == {"overview", "queues", "./"} - {path.lstrip("/")}, links
        r = await client.get("/", headers=h)
        assert {"overview", "queues"} <= set(re.findall(r'<a href="([^"]+)"', await r.text()))
        # every module a page imports is served, as JavaScript
        for name in ("overview.js", "queues.js", "queue.js", "common.js", "chart.js"):
            r = await client.get(f"/static/{name}", headers=h)
            assert r.status == 200 and "javascript" in r.content_type, name
            for imported in re.findall(r'from "\./([\w.]+)"', await r.text()):
                assert (STATIC / imported).is_file(), f"{name} imports a missing {imported}"
        r = await client.get("/static/queues.js", headers=h)
        assert "api/queues" in await r.text()
        r = await client.get("/static/overview.js", headers=h)
        assert "api/overview" in await r.text()
        # the console pages' shells need no cluster read (their scripts ask the API); the ring page embeds its queues
        assert source.calls == [("queues", None)]

    run(body)
