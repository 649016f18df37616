// One node's page (node?name=): /api/nodes/{name} polled every few seconds
// -- its state, partition, registry role and term, uptime, memory, disk,
// descriptors, sockets, processes and alarms -- and the queues it holds
// masters and mirrors of (each a link to the queue's page).
//
// For scripts and tests: #node's data-running, data-masters, data-mirrors
// (counts), data-alarms; data-missing="true" when there is no such node.
import {el, getJSON, num, bytes, uptime, alarmsCell, ApiError, Status} from "./common.js";
import {link, inVhost} from "./listing.js";

const PERIOD_MS = 5000;
const name = new URLSearchParams(location.search).get("name") || "";
const status = new Status(document.getElementById("status"));
const SHOWN = 200;  // queues listed per kind (the counts say how many in all)
let timer = null;

document.getElementById("title").textContent = name;
document.title = `mirrorq · node ${name}`;

function queues(id, list) {
  document.getElementById(`${id}-count`).textContent = `(${num(list.length)})`;
  document.getElementById(id).replaceChildren(list.length
    ? el("ul", {}, ...list.slice(0, SHOWN).map(q => el("li", {"data-queue": q.name},
        link("queue", {vhost: q.vhost, name: q.name}, inVhost(q.vhost, q.name)))),
        ...(list.length > SHOWN ? [el("li", {class: "empty"}, `and ${num(list.length - SHOWN)} more`)] : []))
    : el("span", {class: "empty"}, "none"));
}

function draw(n) {
  const box = document.getElementById("node");
  Object.assign(box.dataset, {running: String(n.running), masters: String(n.queue_masters),
                              mirrors: String(n.queue_mirrors), alarms: (n.alarms || []).join(","), missing: "false"});
  const reg = n.registry || {};
  const rows = [
    ["state", el("span", {class: n.running ? "ok" : "bad"}, n.running ? "running" : "down")],
    ["partition handling", n.partition || "–"],
    ["registry (Raft)", reg.role ? `${reg.role}, term ${reg.term}, leader ${reg.leader || "–"}, commit ${reg.commit_index}` : "–"],
    ["uptime", uptime(n.uptime)],
    ["OS pid", n.os_pid || "–"],
    ["admin address", n.admin || "–"],
    ["memory used / limit", `${bytes(n.mem_used)} / ${bytes(n.mem_limit)}`],
    ["disk free / limit", `${bytes(n.disk_free)} / ${bytes(n.disk_free_limit)}`],
    ["file descriptors", n.fd_used === undefined ? "– (not on this host)" : `${num(n.fd_used)} / ${num(n.fd_total)}`],
    ["sockets", n.sockets_used === undefined ? "–" : num(n.sockets_used)],
    ["processes", n.proc_used === undefined ? "–" : num(n.proc_used)],
    ["alarms", alarmsCell(n)],
  ];
  box.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  queues("masters", n.master_queues || []);
  queues("mirrors", n.mirror_queues || []);
  status.drawn(n.running ? "running" : "down");
}

async function refresh() {
  clearTimeout(timer);
  try {
    draw(await getJSON(`api/nodes/${encodeURIComponent(name)}`));
  } catch (e) {
    if (e instanceof ApiError && e.status === 404) {
      document.getElementById("node").dataset.missing = "true";
    }
    status.failed(e);
  }
  clearTimeout(timer);
  timer = setTimeout(refresh, PERIOD_MS);
}

refresh();
