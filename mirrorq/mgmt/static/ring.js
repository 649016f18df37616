// The live ring view: poll /api/queues, draw one row per queue.
"use strict";

const PERIOD_MS = 2000;
// a request that has not answered by then is given up (and retried): the
// server's own reads time out well before (registry 10 s, queue masters 5 s)
const REQUEST_TIMEOUT_MS = 20000;
let frames = 0;  // frames drawn since the page loaded (the status line's data-frames)

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c);
  return e;
}

function stateClass(state) {
  return state.startsWith("syncing") ? "syncing" : state;
}

function memberChip(m) {
  const label = m.state === "master" ? "master" : m.state;
  const chip = el("span", {class: "member " + stateClass(m.state), title: m.member,
                           "data-node": m.node || "", "data-state": m.state},
                  m.node || m.member, el("small", {}, label));
  if (m.sync && m.sync.progress !== null && m.sync.progress !== undefined) {
    const pct = Math.round(m.sync.progress * 100);
    const bar = el("div", {class: "bar", title: `${pct}% (${m.sync.sent} records sent)`});
    bar.append(el("div", {style: `width:${pct}%`}));
    chip.append(bar);
  }
  return chip;
}

function rate(q, key) {
  const d = (q.message_stats || {})[key + "_details"];
  return d ? d.rate.toFixed(1) : "–";
}

function num(v) {
  return v === null || v === undefined ? "?" : String(v);
}

function row(q) {
  const ring = el("div", {class: "ring"});
  q.ring.forEach((m, i) => {
    if (i) ring.append(el("span", {class: "arrow"}, "→"));
    ring.append(memberChip(m));
  });
  if (q.ring.length) ring.append(el("span", {class: "arrow"}, "↺"));
  const name = el("td", {}, q.vhost === "/" ? q.name : `${q.vhost}/${q.name}`);
  for (const a of q.alerts || []) name.append(el("div", {class: "alert"}, a));
  const master = q.ring.find(m => m.state === "master");
  const tr = el("tr", {"data-queue": q.name, "data-vhost": q.vhost, "data-master": master ? master.node : ""});
  tr.append(name, el("td", {}, ring),
            el("td", {class: "num"}, num(q.messages_ready)), el("td", {class: "num"}, num(q.messages_unacknowledged)),
            el("td", {class: "num", title: "broadcasts not yet held by every mirror"}, num(q.mirror_lag)),
            el("td", {class: "num"}, rate(q, "publish")), el("td", {class: "num"}, rate(q, "deliver_get")),
            el("td", {class: "num"}, rate(q, "ack")), el("td", {class: "num"}, rate(q, "confirm")));
  return tr;
}

function draw(queues) {
  const tbody = document.getElementById("queues");
  tbody.replaceChildren(...(queues.length ? queues.map(row)
                            : [el("tr", {}, el("td", {colspan: "9", class: "empty"}, "no queues"))]));
  const status = document.getElementById("status");
  frames += 1;
  status.dataset.frames = String(frames);
  status.className = "";
  status.textContent = `${queues.length} queue${queues.length === 1 ? "" : "s"} · updated ${new Date().toLocaleTimeString()}`;
}

async function refresh() {
  try {
    // from the page's origin and path: a page opened as http://user:pw@host/ may not fetch a URL with credentials
    const url = new URL("api/queues", location.origin + location.pathname);
    const resp = await fetch(url, {credentials: "same-origin", cache: "no-store",
                                   signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS)});
    if (!resp.ok) {
      const body = await resp.json().catch(() => ({}));
      throw new Error(`${resp.status} ${body.reason || resp.statusText}`);
    }
    draw(await resp.json());
  } catch (e) {
    const status = document.getElementById("status");
    status.className = "error";
    status.textContent = `update failed: ${e.message} (retrying)`;
  } finally {
    setTimeout(refresh, PERIOD_MS);
  }
}

const initial = document.getElementById("initial");
if (initial) draw(JSON.parse(initial.textContent));
setTimeout(refresh, initial ? PERIOD_MS : 0);
