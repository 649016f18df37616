"""The live ring page in a real headless browser while a master's node is
killed (issue #17): Debian's chromium, driven by playwright, opens a node's
page (``GET /``, mirrorq/mgmt/page.py) on a 3-node cluster with a queue
mirrored on every node; once the page shows the queue's master and both
synchronised mirrors it is screenshotted, the master's node is killed with
SIGKILL (its recorded process group), and the same open page -- never
reloaded -- must come to show a master on a surviving node, the one
``mirrorctl list_queues`` and ``/api/queues`` name; then a second
screenshot.  The killed node is started again and the page shows it back
in the ring as a synchronised mirror (a third screenshot).  The
screenshots are kept under the test's ``tmp_path``.

The browser is ``$MIRRORQ_CHROMIUM``, else ``chromium`` on the PATH, else
``/usr/bin/chromium``.  Skips only when there is no chromium binary
(``ctl/install_chromium.sh`` installs Debian's package; ``./dev.sh test``
runs it).  The browser always
goes away with the test: playwright's context managers close it, and the
test then checks no process with its profile directory is left.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import conftest
import pytest
from conftest import wait_for

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

CHROMIUM = os.environ.get("MIRRORQ_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
#: what chromium needs here: no sandbox (root in CI), no GPU, and nothing that
#: reaches out to the network (closed here); playwright adds --headless and
#: --user-data-dir (a fresh profile directory under tmp_path)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
NODES = ("node1", "node2", "node3")
QUEUE = "browser.ring"
MESSAGES = 7
PNG = b"\x89PNG\r\n\x1a\n"


@contextlib.contextmanager
def browser_page(profile: Path, width: int, height: int) -> Iterator[tuple[Any, list[str]]]:
    """A page of a fresh headless chromium (profile directory ``profile``,
    guest's credentials, a ``width`` x ``height`` viewport) and the list its
    scripts' errors go to.  Afterwards the browser is closed and no process
    under its profile is left, or the test fails naming them."""
    from playwright.sync_api import sync_playwright

    try:
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(
                str(profile),
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                http_credentials={"username": "guest", "password": "guest"},
                viewport={"width": width, "height": height},
            )
            try:
                page = ctx.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                yield page, errors
            finally:
                ctx.close()
    finally:
        left = conftest.processes_under(profile)
        conftest.kill_pids(left)
        assert not left, f"chromium processes left running: {left}"


#: the row of one queue as the page draws it: the tr's data-master and each ring member's node and state
ROW_JS = """(name) => {
  const tr = [...document.querySelectorAll("#queues tr[data-queue]")].find(r => r.dataset.queue === name);
  if (!tr) return null;
  const cells = [...tr.children].map(td => td.textContent.trim());
  return {master: tr.dataset.master,
          ring: [...tr.querySelectorAll(".member")].map(m => ({node: m.dataset.node, state: m.dataset.state})),
          ready: cells[2], unacked: cells[3], lag: cells[4],
          frames: Number(document.getElementById("status").dataset.frames || 0),
          status: document.getElementById("status").textContent};
}"""


def _get(c, node: int, path: str) -> tuple[int, bytes]:
    """(status, body) of a GET with guest's basic auth; (0, b"") when nothing answers."""
    req = urllib.request.Request(f"http://127.0.0.1:{c.management_base_port + node}{path}")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def _api_queue(c, node: int) -> tuple[int, dict | None]:
    status, body = _get(c, node, f"/api/queues/%2F/{QUEUE}")
    return status, json.loads(body) if status == 200 else None


def _shown(page) -> dict | None:
    return page.evaluate(ROW_JS, QUEUE)


def _png(path) -> bytes:
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 1000, f"{path} is not a non-empty PNG ({len(data)} bytes)"
    return data


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"no chromium binary at {CHROMIUM} (Debian's package 'chromium'; ctl/install_chromium.sh installs it)",
)
def test_ring_page_follows_a_master_kill_live(cluster3, tmp_path):
    c = cluster3
    assert (
        c.ctl(
            "set_policy",
            "--apply-to",
            "queues",
            "browser-ha",
            r"^browser\.",
            '{"ha-mode":"all","ha-sync-mode":"automatic"}',
        )
        == 0
    )
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port, connection_attempts=3))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(QUEUE, durable=True)
        for i in range(MESSAGES):
            ch.basic_publish("", QUEUE, b"m%d" % i, pika.BasicProperties(delivery_mode=2))
    finally:
        conn.close()
    c.wait_mirrored(QUEUE)
    master = c.queue_row(QUEUE)["pid"]
    assert master in NODES
    # the page of a node that survives the kill
    viewer = NODES[(NODES.index(master) + 1) % 3]
    vi = NODES.index(viewer)
    wait_for(lambda: (_api_queue(c, vi)[0] == 200, None), 30, f"the management server of {viewer}")
    from mirrorq.mgmt.page import STATIC

    assert _get(c, vi, "/static/ring.js") == (200, (STATIC / "ring.js").read_bytes()), (
        "the node serves another tree's page"
    )

    profile = tmp_path / "chromium-profile"
    before_png, after_png, back_png = (tmp_path / f"ring-{n}.png" for n in ("before", "after", "back"))
    with browser_page(profile, 1200, 500) as (page, errors):
        page.goto(f"http://127.0.0.1:{c.management_base_port + vi}/", wait_until="load")
        # master and both mirrors synchronised, in the page as polled (not only the embedded first frame)
        page.wait_for_function(
            """([name, master]) => {
                 const tr = [...document.querySelectorAll("#queues tr[data-queue]")]
                              .find(r => r.dataset.queue === name);
                 const frames = Number(document.getElementById("status").dataset.frames || 0);
                 if (!tr || frames < 2) return false;
                 const ring = [...tr.querySelectorAll(".member")].map(m => m.dataset.state + "@" + m.dataset.node);
                 return tr.dataset.master === master && ring.length === 3
                   && ring.filter(s => s.startsWith("synchronised@")).length === 2;
               }""",
            arg=[QUEUE, master],
            timeout=30_000,
        )
        first = _shown(page)
        assert first["master"] == master and first["ready"] == str(MESSAGES) and first["unacked"] == "0"
        assert sorted(m["node"] for m in first["ring"]) == list(NODES)
        assert [m["state"] for m in first["ring"] if m["node"] == master] == ["master"]
        page.screenshot(path=str(before_png), full_page=True)
        # a mark a reload would wipe: what follows must come from the same, live page
        page.evaluate("() => { window.__mirrorqMark = 'no reload'; }")

        assert c.cluster.kill_node(master), f"{master} was not running"
        survivors = [n for n in NODES if n != master]
        page.wait_for_function(
            """([name, old, survivors]) => {
                 const tr = [...document.querySelectorAll("#queues tr[data-queue]")]
                              .find(r => r.dataset.queue === name);
                 return !!tr && survivors.includes(tr.dataset.master);
               }""",
            arg=[QUEUE, master, survivors],
            timeout=60_000,
        )

        def agreed():
            shown = _shown(page)
            listed = c.queue_row(QUEUE, viewer).get("pid")
            status, api = _api_queue(c, vi)
            api_node = api["node"] if status == 200 else None
            return (
                shown["master"] in survivors
                and shown["master"] == listed == api_node
                and shown["ready"] == str(MESSAGES)
            ), (shown, listed, api_node)

        shown, listed, api_node = wait_for(agreed, 30, "the page, list_queues and the API to name one new master")
        page.screenshot(path=str(after_png), full_page=True)
        assert page.evaluate("() => window.__mirrorqMark") == "no reload"
        assert shown["frames"] > first["frames"]
        new_master = shown["master"]
        assert new_master != master and new_master in survivors
        states = {m["node"]: m["state"] for m in shown["ring"]}
        assert states[new_master] == "master"
        assert states.get(master, "down") == "down", f"the killed node is shown {states.get(master)}"
        assert not errors, f"the page's script failed: {errors}"
        row_text = page.locator(f'#queues tr[data-queue="{QUEUE}"]').inner_text()
        assert QUEUE in row_text and new_master in row_text

        # the node comes back: the same page shows it in the ring again, a mirror caught up by sync
        c.cluster.start_node(master)
        page.wait_for_function(
            """([name, back, master]) => {
                 const tr = [...document.querySelectorAll("#queues tr[data-queue]")]
                              .find(r => r.dataset.queue === name);
                 if (!tr || tr.dataset.master !== master) return false;
                 return [...tr.querySelectorAll(".member")]
                   .some(m => m.dataset.node === back && m.dataset.state === "synchronised");
               }""",
            arg=[QUEUE, master, new_master],
            timeout=60_000,
        )
        page.screenshot(path=str(back_png), full_page=True)
        again = _shown(page)
        assert sorted(m["node"] for m in again["ring"]) == list(NODES) and again["ready"] == str(MESSAGES)
        assert page.evaluate("() => window.__mirrorqMark") == "no reload" and not errors
    assert len({_png(before_png), _png(after_png), _png(back_png)}) == 3
