"""The console's overview and queues pages in a real headless browser on a
3-node cluster (issue #35; mirrorq/mgmt/static/overview.js, queues.js):
Debian's chromium, driven by playwright as in test_mgmt_browser.py, opens a
node's ``/overview`` once 24 queues hold messages; it must come to show the
real totals (queues, messages), three running nodes and no alarm, charted
over at least two polls; messages published while it is open must show as a
publish rate above zero and a higher queued total, in the same page.  Its
"Queues" link opens ``/queues``, which must show the first server-side page
of the 24, sort by total when the header is clicked (twice: descending),
narrow to the filter typed, and page on; the rows shown are those
``/api/queues`` answers for the same query.  A queue's name links to its
page, which shows its messages; its Sync and Purge buttons (each
confirmed in a dialog) answer 204 and the page comes to show it empty, as
mirrorctl does.  Screenshots are saved under
the test's ``tmp_path`` (their paths printed).  The browser goes away with
the test (no process with its profile directory is left).
"""

from __future__ import annotations

import base64
import json
import os
import urllib.request

import pytest
from conftest import wait_for
from test_mgmt_browser import CHROMIUM, PNG, browser_page

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

QUEUES = [f"console.q{i:02d}" for i in range(24)]
#: messages first published into queue i: i % 4
FIRST = {q: i % 4 for i, q in enumerate(QUEUES)}
MORE = 40  # published into console.q01 while the overview is open
VIEWER = 1  # node2's pages


def _api(c, node: int, path: str):
    req = urllib.request.Request(f"http://127.0.0.1:{c.management_base_port + node}{path}")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except OSError:
        return 0, None


def _publish(c, counts: dict[str, int], declare: bool = False) -> None:
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port, connection_attempts=3))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for q, n in counts.items():
            if declare:
                ch.queue_declare(q, durable=True)
            for i in range(n):
                ch.basic_publish("", q, b"m%d" % i, pika.BasicProperties(delivery_mode=2))
    finally:
        conn.close()


#: the overview as drawn: totals, node rows, alarms, samples charted, the newest rates
OVERVIEW_JS = """() => {
  const totals = Object.fromEntries([...document.querySelectorAll("[data-total]")]
                   .map(t => [t.dataset.total, t.dataset.value === "" ? null : Number(t.dataset.value)]));
  const nodes = [...document.querySelectorAll("#nodes tr[data-node]")]
                  .map(r => ({node: r.dataset.node, running: r.dataset.running === "true"}));
  const st = document.getElementById("status");
  return {totals, nodes, alarms: document.getElementById("alarms").dataset.count,
          samples: Number(st.dataset.samples || 0), frames: Number(st.dataset.frames || 0),
          rates: JSON.parse(document.getElementById("rates").dataset.latest || "{}"),
          depths: JSON.parse(document.getElementById("depth").dataset.latest || "{}"), status: st.textContent};
}"""

#: the queues table as drawn: its answer's counts and query, and the rows' queue names
QUEUES_JS = """() => {
  const t = document.querySelector("#list table.listing");
  return {page: Number(t.dataset.page || 0), pageCount: Number(t.dataset.pageCount || 0),
          items: Number(t.dataset.itemCount || 0), filtered: Number(t.dataset.filteredCount || 0),
          total: Number(t.dataset.totalCount || 0), query: t.dataset.query || "",
          rows: [...document.querySelectorAll("#list tr[data-queue]")].map(r => r.dataset.queue),
          status: document.querySelector("#list .status").textContent};
}"""


def _png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 1000, f"{path} is not a non-empty PNG ({len(data)} bytes)"


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"no chromium binary at {CHROMIUM} (Debian's package 'chromium'; ctl/install_chromium.sh installs it)",
)
def test_overview_and_queues_pages_show_the_cluster(cluster3, tmp_path):
    c = cluster3
    _publish(c, FIRST, declare=True)
    first_total = sum(FIRST.values())
    wait_for(lambda: (_api(c, VIEWER, "/api/overview")[0] == 200, None), 30, "node2's management server")

    profile = tmp_path / "chromium-profile"
    shots = {
        n: tmp_path / f"console-{n}.png"
        for n in ("overview", "overview-rates", "queues", "queues-filtered", "queue-purged")
    }
    base = f"http://127.0.0.1:{c.management_base_port + VIEWER}"
    with browser_page(profile, 1280, 900) as (page, errors):
        page.goto(f"{base}/overview", wait_until="load")

        # ---- the overview: real figures, charted over two polls at least
        page.wait_for_function(
            """([queues, messages]) => {
                 const v = k => { const t = document.querySelector(`[data-total="${k}"]`);
                                  return t ? Number(t.dataset.value) : null; };
                 const rows = [...document.querySelectorAll("#nodes tr[data-node]")];
                 return Number(document.getElementById("status").dataset.samples || 0) >= 2
                   && v("queues") === queues && v("messages") === messages
                   && rows.length === 3 && rows.every(r => r.dataset.running === "true")
                   && document.getElementById("alarms").dataset.count === "0";
               }""",
            arg=[len(QUEUES), first_total],
            timeout=60_000,
        )
        shown = page.evaluate(OVERVIEW_JS)
        assert sorted(n["node"] for n in shown["nodes"]) == ["node1", "node2", "node3"]
        assert shown["totals"]["messages_ready"] == first_total
        assert shown["totals"]["exchanges"] == len(_api(c, VIEWER, "/api/exchanges")[1])
        assert shown["depths"]["messages"] == first_total
        page.screenshot(path=str(shots["overview"]), full_page=True)
        page.evaluate("() => { window.__mirrorqMark = 'no reload'; }")

        _publish(c, {QUEUES[1]: MORE})
        page.wait_for_function(
            """(messages) => {
                 const rates = JSON.parse(document.getElementById("rates").dataset.latest || "{}");
                 const t = document.querySelector('[data-total="messages"]');
                 return rates.publish > 0 && t && Number(t.dataset.value) === messages;
               }""",
            arg=first_total + MORE,
            timeout=60_000,
        )
        moved = page.evaluate(OVERVIEW_JS)
        assert moved["samples"] > shown["samples"] and moved["rates"]["publish"] > 0
        assert page.evaluate("() => window.__mirrorqMark") == "no reload"
        page.screenshot(path=str(shots["overview-rates"]), full_page=True)

        # ---- the queues list: the nav link, server-side pages
        page.click("nav >> text=Queues")
        page.wait_for_url(f"{base}/queues")
        page.wait_for_function(
            "(n) => Number(document.querySelector('#list table.listing').dataset.totalCount || 0) === n",
            arg=len(QUEUES),
            timeout=30_000,
        )
        listed = page.evaluate(QUEUES_JS)
        assert (listed["page"], listed["pageCount"], listed["items"]) == (1, 2, 20)
        assert listed["rows"] == QUEUES[:20]  # sorted by name by default

        page.click('th[data-sort="messages"]')
        page.wait_for_function(
            "() => (document.querySelector('#list table.listing').dataset.query || '').includes('sort=messages')"
        )
        page.click('th[data-sort="messages"]')  # again: descending
        page.wait_for_function(
            "() => (document.querySelector('#list table.listing').dataset.query || '').includes('sort=messages&sort_reverse=true')"
        )
        by_depth = page.evaluate(QUEUES_JS)
        assert by_depth["rows"][0] == QUEUES[1]  # 1 + MORE messages: the deepest
        status, api = _api(c, VIEWER, "/api/queues?" + by_depth["query"])
        assert status == 200 and [q["name"] for q in api["items"]] == by_depth["rows"]
        assert "sort=messages" in page.url and "sort_reverse=true" in page.url  # the view is linkable
        page.screenshot(path=str(shots["queues"]), full_page=True)

        page.fill("#list input.filter", "q1")
        page.wait_for_function(
            "() => Number(document.querySelector('#list table.listing').dataset.filteredCount || -1) === 10"
        )
        filtered = page.evaluate(QUEUES_JS)
        assert sorted(filtered["rows"]) == [f"console.q{i}" for i in range(10, 20)]
        assert (filtered["total"], filtered["pageCount"]) == (len(QUEUES), 1)
        page.fill("#list input.filter", "")
        page.wait_for_function(
            "() => Number(document.querySelector('#list table.listing').dataset.filteredCount || -1) === 24"
        )
        page.click("#list button.next")
        page.wait_for_function("() => document.querySelector('#list table.listing').dataset.page === '2'")
        second = page.evaluate(QUEUES_JS)
        assert second["items"] == 4 and not set(second["rows"]) & set(by_depth["rows"])
        assert sorted(by_depth["rows"] + second["rows"]) == QUEUES
        page.fill("#list input.filter", "q1")
        page.wait_for_function(
            "() => Number(document.querySelector('#list table.listing').dataset.filteredCount || -1) === 10"
        )
        page.screenshot(path=str(shots["queues-filtered"]), full_page=True)

        # ---- a queue's page from its link: sync, then purge (each confirmed in a dialog)
        page.fill("#list input.filter", "")
        page.wait_for_function(
            "(q) => [...document.querySelectorAll('#list tr[data-queue]')].some(r => r.dataset.queue === q)",
            arg=QUEUES[1],
        )
        page.click(f'#list tr[data-queue="{QUEUES[1]}"] a')
        page.wait_for_function(
            "(n) => document.getElementById('queue').dataset.messages === String(n)",
            arg=FIRST[QUEUES[1]] + MORE,
        )
        asked: list[str] = []

        def accept(dialog) -> None:
            asked.append(dialog.message)
            dialog.accept()

        page.on("dialog", accept)
        page.click('#actions button[data-action="sync"]')
        page.wait_for_function("() => document.getElementById('actions').dataset.done === 'sync 204'")
        page.click('#actions button[data-action="purge"]')
        page.wait_for_function("() => document.getElementById('actions').dataset.done === 'purge 204'")
        page.wait_for_function("() => document.getElementById('queue').dataset.messages === '0'")
        assert [a.split(" queue ")[0] for a in asked] == [
            "Synchronise the mirrors of",
            "Remove every ready message of",
        ]
        assert f"queue '{QUEUES[1]}' in vhost '/'" in asked[-1]
        assert c.queue_row(QUEUES[1])["messages"] == 0  # mirrorctl sees it purged too
        page.screenshot(path=str(shots["queue-purged"]), full_page=True)
        assert not errors, f"the pages' scripts failed: {errors}"
    for name, path in shots.items():
        _png(path)
        print(f"screenshot {name}: {path}")
