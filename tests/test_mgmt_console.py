"""The console pages' routes (mirrorq.mgmt.page, issue #35) over the fake
source of test_mgmt_app: every page is served (auth as the API), loads
its module from /static/, and links the others from its nav;
tests/cluster/test_mgmt_console_browser.py runs them in a browser."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("aiohttp")

from test_mgmt_app import ADMIN, PLAIN, basic, run  # noqa: E402

from mirrorq.mgmt.page import STATIC  # noqa: E402

#: the pages in every page's nav (a page shows itself in bold, not as a link)
NAV = {"overview", "nodes", "connections", "channels", "exchanges", "queues", "admin", "./"}
#: every console page (the ring page "/" aside)
PAGES = (
    "/overview",
    "/nodes",
    "/node",
    "/connections",
    "/channels",
    "/exchanges",
    "/exchange",
    "/queues",
    "/queue",
    "/admin",
)


def test_console_pages_are_served_with_their_modules_and_link_each_other():
    async def body(client, source):
        h = basic(*ADMIN)
        for path in PAGES:
            script = path.lstrip("/") + ".js"
            r = await client.get(path)
            assert r.status == 401
            r = await client.get(path, headers=basic(*PLAIN))
            assert r.status == 403
            r = await client.get(path, headers=h)
            assert r.status == 200 and r.content_type == "text/html" and r.headers["Cache-Control"] == "no-cache"
            html = await r.text()
            assert f'<script type="module" src="static/{script}"></script>' in html
            links = set(re.findall(r'<a href="([^"]+)"', html))
            assert links == NAV - {path.lstrip("/")}, links
        r = await client.get("/", headers=h)
        assert NAV - {"./"} <= set(re.findall(r'<a href="([^"]+)"', await r.text()))
        # every module a page imports is served, as JavaScript
        for name in sorted(p.name for p in STATIC.glob("*.js")):
            r = await client.get(f"/static/{name}", headers=h)
            assert r.status == 200 and "javascript" in r.content_type, name
            for imported in re.findall(r'from "\./([\w.-]+)"', await r.text()):
                assert (STATIC / imported).is_file(), f"{name} imports a missing {imported}"
        r = await client.get("/static/queues.js", headers=h)
        assert "api/queues" in await r.text()
        r = await client.get("/static/overview.js", headers=h)
        assert "api/overview" in await r.text()
        # the console pages' shells need no cluster read (their scripts ask the API); the ring page embeds its queues
        assert source.calls == [("queues", None)]

    run(body)
