"""The console's forms and its other pages in a real headless browser on a
3-node cluster (issue #35): Debian's chromium, driven by playwright as in
test_mgmt_browser.py (the shared ``browser_page`` fixture).

* a queue's page: messages published from its form are got back from its
  get form (ack mode "reject requeue true": still there, now redelivered),
  then got with "automatic ack" (gone); a bad count shows the API's reason;
* /exchanges: an exchange declared from its form is listed; its page binds
  the queue, publishes a message routed to it, shows a bind to a missing
  queue failing with the API's reason, unbinds (the next publish is
  unroutable) and deletes the exchange;
* /connections: a client's connection is listed and closed from its
  button (the client hears 320 CONNECTION_FORCED); /channels lists its
  channel;
* /admin: a user, its permissions and a policy added from the forms, shown,
  and deleted from their rows' buttons;
* /nodes and /node: every node running, the queue held on each; then the
  queue's master's node is killed (SIGKILL of its process group) and the
  same open pages, never reloaded, come to show it down while the queue's
  master moves; every other page, opened again on the survivor, is drawn
  without a failed update (the queue's page naming the new master).
  Screenshots of each page before and after the kill (under the test's
  ``tmp_path``, their paths printed; docs/screenshots/ has a run's).

The browser and the cluster go away with the test.
"""

from __future__ import annotations

import os
import re

import pytest
from conftest import wait_for
from test_mgmt_browser import CHROMIUM, PNG, browser_page
from test_mgmt_console_browser import _api, _publish

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

Q = "forms.q"
VIEWER = 1  # node2's pages


def _png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 1000, f"{path} is not a non-empty PNG ({len(data)} bytes)"


def _done(page, form: str, want: str) -> str:
    """Wait until ``form``'s data-done is ``want`` (a regex); the outcome line's text."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            "([f, w]) => new RegExp(w).test(document.getElementById(f).dataset.done || '')", arg=[form, want]
        )
    except PlaywrightTimeout:
        shown = page.evaluate(
            "(f) => [document.getElementById(f).dataset.done, document.getElementById(f).textContent]", form
        )
        raise AssertionError(f"form {form}: wanted {want}, shows {shown}") from None
    return page.evaluate("(f) => document.getElementById(f).textContent", form)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no chromium binary at {CHROMIUM}")
def test_forms_and_pages_then_a_node_kill(cluster3, tmp_path):
    c = cluster3
    c.ctl("set_policy", "forms", "^forms\\.", '{"ha-mode": "all"}')
    _publish(c, {Q: 0}, declare=True)
    c.wait_mirrored(Q)
    wait_for(lambda: (_api(c, VIEWER, "/api/overview")[0] == 200, None), 30, "node2's management server")
    base = f"http://127.0.0.1:{c.management_base_port + VIEWER}"
    shots: dict[str, object] = {}
    dialogs: list[str] = []

    with browser_page(tmp_path / "chromium-profile", 1280, 900) as (page, errors):
        page.on("dialog", lambda d: (dialogs.append(d.message), d.accept()))

        # ---- a queue's page: publish, get with requeue, get with automatic ack, a bad count
        page.goto(f"{base}/queue?vhost=%2F&name={Q}", wait_until="load")
        page.click("#publish-panel summary")
        for body in ("first", "second"):
            page.fill("#pub-payload", body)
            page.click("#publish-form button[type=submit]")
            _done(page, "publish-form", "^publish 200$")
            page.evaluate("() => { delete document.getElementById('publish-form').dataset.done; }")
        assert page.evaluate("() => document.getElementById('publish-form').dataset.routed") == "true"
        page.wait_for_function("() => document.getElementById('queue').dataset.messages === '2'")
        page.click("#get-panel summary")
        page.fill("#get-count", "5")
        page.select_option("#get-ackmode", "reject_requeue_true")
        page.click("#get-form button[type=submit]")
        _done(page, "get-form", "^get 200$")
        got = page.evaluate(
            "() => [...document.querySelectorAll('#got .message')].map(m => [m.dataset.payload, m.dataset.redelivered])"
        )
        assert got == [["first", "false"], ["second", "false"]]
        page.select_option("#get-ackmode", "ack_requeue_false")
        page.fill("#get-count", "1")
        page.evaluate("() => { delete document.getElementById('get-form').dataset.done; }")
        page.click("#get-form button[type=submit]")
        _done(page, "get-form", "^get 200$")
        got = page.evaluate(
            "() => [...document.querySelectorAll('#got .message')].map(m => [m.dataset.payload, m.dataset.redelivered])"
        )
        assert got == [["first", "true"]]  # requeued by the reject: redelivered
        page.wait_for_function("() => document.getElementById('queue').dataset.messages === '1'")
        page.fill("#get-count", "0")
        page.evaluate("() => { delete document.getElementById('get-form').dataset.done; }")
        page.evaluate("() => document.getElementById('get-count').removeAttribute('min')")
        page.click("#get-form button[type=submit]")
        text = _done(page, "get-form", "^get 400$")
        assert "count: must be a whole number 1..1000, got '0'" in text, text
        shots["queue-before"] = tmp_path / "queue-before.png"
        page.screenshot(path=str(shots["queue-before"]), full_page=True)

        # ---- exchanges: declare from the form, then its page: bind, publish, a failing bind, unbind, delete
        page.goto(f"{base}/exchanges", wait_until="load")
        page.click("#add-panel summary")
        page.fill("#add-exchange-name", "forms.x")
        page.select_option("#add-exchange-type", "topic")
        page.click("#add-exchange button[type=submit]")
        assert "added" in _done(page, "add-exchange", "^add exchange 201$")
        page.wait_for_function(
            "() => [...document.querySelectorAll('table.listing tr[data-name]')].some(r => r.dataset.name === '//forms.x')"
        )
        shots["exchanges-before"] = tmp_path / "exchanges-before.png"
        page.screenshot(path=str(shots["exchanges-before"]), full_page=True)
        page.click("a:text('forms.x')")
        page.wait_for_function("() => document.getElementById('exchange').dataset.type === 'topic'")
        page.click("#bind-panel summary")
        page.fill("#bind-form-destination", Q)
        page.fill("#bind-form-routing_key", "forms.#")
        page.click("#bind-form button[type=submit]")
        _done(page, "bind-form", "^bind 201$")
        page.wait_for_function(
            "(q) => [...document.querySelectorAll('#bindings tr[data-destination]')].some(r => r.dataset.destination === q)",
            arg=Q,
        )
        page.fill("#bind-form-destination", "no.such.queue")
        page.click("#bind-form button[type=submit]")
        assert "no queue 'no.such.queue' in vhost '/'" in _done(page, "bind-form", "^bind 404$")
        page.click("#publish-panel summary")
        page.fill("#pub-routing-key", "forms.new")
        page.fill("#pub-payload", "via the exchange")
        page.click("#publish-form button[type=submit]")
        _done(page, "publish-form", "^publish 200$")
        assert page.evaluate("() => document.getElementById('publish-form').dataset.routed") == "true"
        shots["exchange-before"] = tmp_path / "exchange-before.png"
        page.screenshot(path=str(shots["exchange-before"]), full_page=True)
        page.click(f'#bindings tr[data-destination="{Q}"] button')
        page.wait_for_function("() => !document.querySelector('#bindings tr[data-destination]')")
        page.evaluate("() => { delete document.getElementById('publish-form').dataset.done; }")
        page.click("#publish-form button[type=submit]")
        _done(page, "publish-form", "^publish 200$")
        assert page.evaluate("() => document.getElementById('publish-form').dataset.routed") == "false"
        page.click('#actions button[data-action="delete"]')
        page.wait_for_function("() => document.getElementById('actions').dataset.done === 'delete 204'")
        assert _api(c, VIEWER, "/api/exchanges/%2F/forms.x")[0] == 0  # urllib: 404 is an error
        assert c.queue_row(Q)["messages"] == 2  # "second" and the one routed by forms.x

        # ---- connections and channels: a client's connection listed, its channel too, closed from its button
        client = pika.BlockingConnection(
            pika.ConnectionParameters(
                "127.0.0.1", c.amqp_base_port + 2, client_properties={"connection_name": "forms-client"}
            )
        )
        try:
            client.channel()
            page.goto(f"{base}/connections", wait_until="load")
            row = "table.listing tr[data-name*='127.0.0.1']"
            page.wait_for_selector(row)
            conn_name = page.evaluate(f'() => document.querySelector("{row}").dataset.name')
            page.goto(f"{base}/channels", wait_until="load")
            page.wait_for_function(
                "(n) => [...document.querySelectorAll('table.listing tr[data-name]')].some(r => r.dataset.name.startsWith(n))",
                arg=conn_name,
            )
            shots["channels-before"] = tmp_path / "channels-before.png"
            page.screenshot(path=str(shots["channels-before"]), full_page=True)
            page.goto(f"{base}/connections", wait_until="load")
            page.wait_for_selector(row)
            shots["connections-before"] = tmp_path / "connections-before.png"
            page.screenshot(path=str(shots["connections-before"]), full_page=True)
            page.click(f"{row} button")
            page.wait_for_function("() => !document.querySelector(\"table.listing tr[data-name*='127.0.0.1']\")")
            with pytest.raises(pika.exceptions.ConnectionClosed) as closed:
                for _ in range(50):
                    client.process_data_events(time_limit=0.2)
            assert "CONNECTION_FORCED" in str(closed.value) and "mirrorq console" in str(closed.value)
        finally:
            if client.is_open:
                client.close()

        # ---- admin: a user, its permissions and a policy, added and deleted
        page.goto(f"{base}/admin", wait_until="load")
        for summary in page.query_selector_all("details.panel summary"):
            summary.click()
        page.fill("#user-name", "forms-user")
        page.fill("#user-password", "s3cret")
        page.fill("#user-tags", "monitoring")
        page.click("#user button[type=submit]")
        _done(page, "user", "^put user 201$")
        page.fill("#permission-user", "forms-user")
        page.fill("#permission-read", "^forms\\.")
        page.click("#permission button[type=submit]")
        _done(page, "permission", "^set permissions 204$|^set permissions 201$")
        page.fill("#policy-name", "forms-dlx")
        page.fill("#policy-pattern", "^forms\\.dlx")
        page.fill("#policy-definition", '{"dead-letter-exchange": "forms.dead"}')
        page.click("#policy button[type=submit]")
        _done(page, "policy", "^put policy 201$")
        page.fill("#policy-definition", '{"ha-mode": "sometimes"}')
        page.click("#policy button[type=submit]")
        assert "ha-mode" in _done(page, "policy", "^put policy 400$")
        page.wait_for_selector('#users tr[data-name="forms-user"]')
        page.wait_for_selector('#permissions-table tr[data-user="forms-user"]')
        page.wait_for_selector('#policies tr[data-name="//forms-dlx"]')
        shots["admin-before"] = tmp_path / "admin-before.png"
        page.screenshot(path=str(shots["admin-before"]), full_page=True)
        assert [p["read"] for p in c.json("list_permissions", "-p", "/") if p["user"] == "forms-user"] == ["^forms\\."]
        page.click('#policies tr[data-name="//forms-dlx"] button')
        page.wait_for_selector('#policies tr[data-name="//forms-dlx"]', state="detached")
        page.click('#users tr[data-name="forms-user"] button')
        page.wait_for_selector('#users tr[data-name="forms-user"]', state="detached")
        page.wait_for_selector('#permissions-table tr[data-user="forms-user"]', state="detached")

        # ---- nodes: every node running and holding the queue; then its master's node is killed
        master = c.queue_row(Q)["pid"]
        assert master != "node2"
        page.goto(f"{base}/nodes", wait_until="load")
        page.wait_for_function(
            """() => { const rows = [...document.querySelectorAll('#nodes tr[data-node]')];
                       return rows.length === 3 && rows.every(r => r.dataset.running === 'true'
                         && Number(r.dataset.masters) + Number(r.dataset.mirrors) >= 1); }"""
        )
        shots["nodes-before"] = tmp_path / "nodes-before.png"
        page.screenshot(path=str(shots["nodes-before"]), full_page=True)
        node_page = page.context.new_page()
        node_page.goto(f"{base}/node?name={master}", wait_until="load")
        node_page.wait_for_function(
            "(q) => [...document.querySelectorAll('#masters li[data-queue]')].some(l => l.dataset.queue === q)", arg=Q
        )
        shots["node-before"] = tmp_path / "node-before.png"
        node_page.screenshot(path=str(shots["node-before"]), full_page=True)

        assert c.cluster.kill_node(master), f"{master} was not running"
        page.wait_for_function(
            "(n) => document.querySelector(`#nodes tr[data-node='${n}']`)?.dataset.running === 'false'",
            arg=master,
            timeout=60_000,
        )
        node_page.wait_for_function("() => document.getElementById('node').dataset.running === 'false'", timeout=60_000)
        new_master = wait_for(
            lambda: ((m := (_api(c, VIEWER, f"/api/queues/%2F/{Q}")[1] or {}).get("node")) not in (None, master), m),
            60,
            "a new master",
        )
        page.wait_for_function(
            "(n) => Number(document.querySelector(`#nodes tr[data-node='${n}']`)?.dataset.masters) >= 1",
            arg=new_master,
            timeout=30_000,
        )
        shots["nodes-after"] = tmp_path / "nodes-after.png"
        page.screenshot(path=str(shots["nodes-after"]), full_page=True)
        node_page.wait_for_function(
            "(q) => ![...document.querySelectorAll('#masters li[data-queue]')].some(l => l.dataset.queue === q)",
            arg=Q,
            timeout=30_000,
        )
        shots["node-after"] = tmp_path / "node-after.png"
        node_page.screenshot(path=str(shots["node-after"]), full_page=True)
        node_page.close()

        # ---- every other page, opened on the survivor after the kill: drawn, no failed update
        page.goto(f"{base}/queue?vhost=%2F&name={Q}", wait_until="load")
        page.wait_for_function("(n) => document.getElementById('queue').dataset.node === n", arg=new_master)
        shots["queue-after"] = tmp_path / "queue-after.png"
        page.screenshot(path=str(shots["queue-after"]), full_page=True)
        for name in ("exchanges", "connections", "channels", "admin"):
            page.goto(f"{base}/{name}", wait_until="load")
            page.wait_for_function(
                """() => { const s = [...document.querySelectorAll('.status, #status')];
                           return s.length && s.every(n => Number(n.dataset.frames || 0) >= 1
                                                           && !n.classList.contains('error')); }"""
            )
            shots[f"{name}-after"] = tmp_path / f"{name}-after.png"
            page.screenshot(path=str(shots[f"{name}-after"]), full_page=True)
        page.goto(f"{base}/exchange?vhost=%2F&name=amq.topic", wait_until="load")
        page.wait_for_function("() => document.getElementById('exchange').dataset.type === 'topic'")
        shots["exchange-after"] = tmp_path / "exchange-after.png"
        page.screenshot(path=str(shots["exchange-after"]), full_page=True)
        assert not errors, f"the pages' scripts failed: {errors}"

    assert any("Delete exchange 'forms.x'" in d for d in dialogs) and any("Close connection" in d for d in dialogs)
    for name, path in shots.items():
        _png(path)
        print(f"screenshot {name}: {path}")
    assert re.search(r"node\d", master)
