"""The console pages: ``GET /`` every queue's GM ring, live; ``/overview``; ``/queues``; the others.

``/overview`` (``static/overview.html`` + ``overview.js``) polls
``/api/overview``, ``/api/nodes`` and ``/api/health/checks/alarms`` every
five seconds and charts the message rates and queued messages of the last
ten minutes on ``<canvas>`` elements (``chart.js``, drawn by hand), with the
object and queue totals, the alarms in effect and every node's state.
``/queues`` (``queues.html`` + ``queues.js``) shows one page of
``/api/queues`` at a time, sorted, filtered and paged by the server
(:mod:`.paging`), its query in the page's URL; each name links to
``/queue?vhost=&name=`` (``queue.html`` + ``queue.js``): the queue's figures,
ring and policy, polled, and its actions (purge, sync, cancel sync, delete;
each confirmed first).  Both are plain ES modules
(``common.js`` shared), no build step.

The other pages, each ``<name>.html`` + ``<name>.js``: ``/nodes`` (every
node's state, resources, alarms and queues held) and ``/node?name=`` (one
node with the queues it holds masters and mirrors of); ``/exchanges``
(paged, with a declare form) and ``/exchange?vhost=&name=`` (its bindings
with unbind buttons, a bind form, the publish form, delete);
``/connections`` (paged, each with a Close button) and ``/channels``;
``/admin`` (users, vhosts, permissions, policies: listed with delete
buttons, and a form for each).  The paged tables are ``listing.js``', the
forms ``forms.js``' and ``messages.js``' (get messages and publish, on the
queue and exchange pages too); what they show is in data attributes
(see each script's header) for scripts and tests.  The ring page below
links to them.

``GET /``: every queue's GM ring, live, in a browser.

A plain HTML page (``static/index.html``) and a small script
(``static/ring.js``), no build step.  The page is served with the queues of
the moment in it (``/api/queues``' objects, as JSON in a
``<script type="application/json" id="initial">`` element: the first frame
needs no round trip, and what a page shows can be checked without a
browser); then the script polls ``/api/queues`` every
two seconds (the browser sends the basic-auth credentials it was asked for
when it loaded the page) and draws one row per queue: its master and mirrors
in ring order (the order GM forwards in), each synchronised, unsynchronised,
syncing with a progress bar, or down; its messages (ready / unacked), the
master's mirror lag (broadcasts not yet held by every mirror) and rates
(publish, deliver, ack, confirm per second, from the API's
``*_details.rate``).  The page is never reloaded: each answer redraws the
table in place, so a master's node dying shows as its member going down
and another member becoming the master.  For scripts and tests the DOM
carries the data: each row ``data-queue`` / ``data-vhost`` /
``data-master`` (the master's node, "" while there is none), each ring
member ``data-node`` / ``data-state``, and the status line ``data-frames``
(frames drawn since the page loaded, the embedded first one included).  A request unanswered
after 20 s is given up and the status line says the update failed until
one succeeds.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).with_name("static")
MARK = "<!--initial-->"


def render(template: str, queues: list[dict]) -> str:
    """The page with ``queues`` embedded (``</`` escaped: JSON cannot end the script element)."""
    data = json.dumps(queues, default=str).replace("</", "<\\/")
    return template.replace(MARK, f'<script type="application/json" id="initial">{data}</script>')


def add_routes(app: web.Application, source) -> None:
    async def index(request: web.Request) -> web.Response:
        queues = await asyncio.to_thread(source.queues)
        html = render((STATIC / "index.html").read_text(), queues)
        return web.Response(text=html, content_type="text/html", headers={"Cache-Control": "no-cache"})

    def static_page(filename: str):
        async def handler(request: web.Request) -> web.Response:
            html = (STATIC / filename).read_text()
            return web.Response(text=html, content_type="text/html", headers={"Cache-Control": "no-cache"})

        return handler

    app.router.add_get("/", index)
    app.router.add_get("/overview", static_page("overview.html"))
    app.router.add_get("/queues", static_page("queues.html"))
    app.router.add_get("/queue", static_page("queue.html"))
    for name in ("nodes", "node", "exchanges", "exchange", "connections", "channels", "admin"):
        app.router.add_get(f"/{name}", static_page(f"{name}.html"))
    app.router.add_static("/static/", STATIC)
