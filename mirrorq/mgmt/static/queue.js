// One queue's page: /api/queues/{vhost}/{name} polled every few seconds
// (the queue named by the page's ?vhost=&name=), and its actions -- purge,
// sync, cancel sync, delete -- each confirmed first, through RabbitMQ's API
// (DELETE .../contents, POST .../actions, DELETE the queue); the get-messages
// and publish forms (messages.js: POST .../get, and a publish to the default
// exchange with the queue's name as the routing key).
//
// For scripts and tests: #queue's data-messages, data-node and data-state
// (data-missing="true" once the queue is gone); #actions' data-done (the
// last action and its answer's status, e.g. "purge 204").
import {el, getJSON, apiURL, num, rate, ApiError, Status, REQUEST_TIMEOUT_MS} from "./common.js";
import {mountGet, mountPublish} from "./messages.js";

const PERIOD_MS = 3000;
const params = new URLSearchParams(location.search);
const vhost = params.get("vhost") || "/", name = params.get("name") || "";
const path = `api/queues/${encodeURIComponent(vhost)}/${encodeURIComponent(name)}`;
const status = new Status(document.getElementById("status"));
let timer = null;

document.getElementById("title").textContent = vhost === "/" ? name : `${vhost}/${name}`;
document.title = `mirrorq · queue ${name}`;

function prop(label, value) {
  return el("tr", {}, el("th", {}, label), el("td", {}, value));
}

function stat(q, key) {
  const d = (q.message_stats || {})[`${key}_details`];
  return d ? `${num(q.message_stats[key])} (${rate(d.rate)}/s)` : "–";
}

function ring(q) {
  if (!q.ring || !q.ring.length) return "–";
  return el("span", {}, ...q.ring.map((m, i) => el("span", {"data-node": m.node || "", "data-state": m.state},
    `${i ? " → " : ""}${m.node || m.member} (${m.state}${m.sync && m.sync.progress != null
      ? ` ${Math.round(m.sync.progress * 100)}%` : ""})`)));
}

function draw(q) {
  const table = document.getElementById("queue");
  Object.assign(table.dataset, {messages: String(q.messages ?? ""), node: q.node || "", state: q.state,
                                missing: "false"});
  document.getElementById("props").replaceChildren(
    prop("state", el("span", {class: `state-${q.state}`}, q.state + (q.alerts && q.alerts.length ? ` (${q.alerts.join("; ")})` : ""))),
    prop("master", q.node || "–"),
    prop("mirrors", (q.slave_nodes || []).join(", ") || "–"),
    prop("synchronised mirrors", (q.synchronised_slave_nodes || []).join(", ") || "–"),
    prop("GM ring", ring(q)),
    prop("mirror lag", num(q.mirror_lag)),
    prop("messages (ready / unacked)", `${num(q.messages)} (${num(q.messages_ready)} / ${num(q.messages_unacknowledged)})`),
    prop("published", stat(q, "publish")),
    prop("confirmed", stat(q, "confirm")),
    prop("delivered", stat(q, "deliver_get")),
    prop("acknowledged", stat(q, "ack")),
    prop("consumers", num(q.consumers)),
    prop("policy", q.policy || "–"),
    prop("durable / auto delete / exclusive", `${q.durable} / ${q.auto_delete} / ${q.exclusive}`),
    prop("arguments", JSON.stringify(q.arguments || {})));
  status.drawn(q.state);
}

async function refresh() {
  clearTimeout(timer);
  try {
    draw(await getJSON(path));
  } catch (e) {
    if (e instanceof ApiError && e.status === 404) {
      document.getElementById("queue").dataset.missing = "true";
      document.getElementById("props").replaceChildren(el("tr", {}, el("td", {class: "empty"}, e.reason)));
    }
    status.failed(e);
  }
  clearTimeout(timer);
  timer = setTimeout(refresh, PERIOD_MS);
}

const ACTIONS = {
  purge: {ask: "Remove every ready message of", method: "DELETE", url: `${path}/contents`},
  sync: {ask: "Synchronise the mirrors of", method: "POST", url: `${path}/actions`, body: {action: "sync"}},
  cancel_sync: {ask: "Stop synchronising", method: "POST", url: `${path}/actions`, body: {action: "cancel_sync"}},
  delete: {ask: "Delete, with its messages,", method: "DELETE", url: path},
};

async function act(action) {
  const a = ACTIONS[action];
  if (!confirm(`${a.ask} queue '${name}' in vhost '${vhost}'?`)) return;
  const done = document.getElementById("done"), box = document.getElementById("actions");
  try {
    const resp = await fetch(apiURL(a.url), {method: a.method, credentials: "same-origin", cache: "no-store",
      headers: a.body ? {"Content-Type": "application/json"} : {},
      body: a.body ? JSON.stringify(a.body) : undefined, signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS)});
    const reason = resp.ok ? "" : ((await resp.json().catch(() => ({}))).reason || resp.statusText);
    box.dataset.done = `${action} ${resp.status}`;
    done.className = resp.ok ? "ok" : "bad";
    done.textContent = resp.ok ? `${action.replace("_", " ")}: done` : `${action.replace("_", " ")} failed: ${reason}`;
  } catch (e) {
    box.dataset.done = `${action} failed`;
    done.className = "bad";
    done.textContent = `${action.replace("_", " ")} failed: ${e.message}`;
  }
  refresh();
}

mountGet(document.getElementById("get"), vhost, name, refresh);
mountPublish(document.getElementById("publish"), vhost, "", name, refresh);
for (const b of document.querySelectorAll("#actions button[data-action]")) {
  b.addEventListener("click", () => act(b.dataset.action));
}
refresh();
