// The nodes: /api/nodes polled every few seconds, one row per node with its
// state as the serving node sees it, partition, registry role, uptime,
// memory, disk, descriptors, sockets, processes, the queues it holds
// masters and mirrors of, and its alarms; each name links to its page
// (node?name=).
//
// For scripts and tests: each row's data-node, data-running,
// data-masters, data-mirrors, data-alarms (comma-separated).
import {el, getJSON, num, bytes, uptime, alarmsCell, Status} from "./common.js";
import {link} from "./listing.js";

const PERIOD_MS = 5000;
const status = new Status(document.getElementById("status"));
let timer = null;

function draw(nodes) {
  document.getElementById("nodes").replaceChildren(...nodes.map(n => {
    const reg = n.registry || {};
    const of = (used, total) => used === undefined || used === null ? "–" : total ? `${num(used)} / ${num(total)}` : num(used);
    return el("tr", {"data-node": n.name, "data-running": String(n.running), "data-masters": String(n.queue_masters),
                     "data-mirrors": String(n.queue_mirrors), "data-alarms": (n.alarms || []).join(",")},
              el("td", {}, link("node", {name: n.name}, n.name)),
              el("td", {class: n.running ? "ok" : "bad"}, n.running ? "running" : "down"),
              el("td", {}, n.partition || "–"),
              el("td", {}, reg.role ? `${reg.role} (term ${reg.term})` : "–"),
              el("td", {class: "num"}, uptime(n.uptime)),
              el("td", {class: "num"}, n.running ? bytes(n.mem_used) : "–"),
              el("td", {class: "num"}, n.running ? bytes(n.mem_limit) : "–"),
              el("td", {class: "num"}, n.running ? bytes(n.disk_free) : "–"),
              el("td", {class: "num"}, n.running ? bytes(n.disk_free_limit) : "–"),
              el("td", {class: "num"}, of(n.fd_used, n.fd_total)),
              el("td", {class: "num"}, of(n.sockets_used)),
              el("td", {class: "num"}, of(n.proc_used)),
              el("td", {class: "num"}, num(n.queue_masters)),
              el("td", {class: "num"}, num(n.queue_mirrors)),
              el("td", {}, alarmsCell(n)));
  }));
  const up = nodes.filter(n => n.running).length;
  status.drawn(`${up} of ${nodes.length} nodes running`);
}

async function refresh() {
  clearTimeout(timer);
  try {
    draw(await getJSON("api/nodes"));
  } catch (e) {
    status.failed(e);
  }
  clearTimeout(timer);
  timer = setTimeout(refresh, PERIOD_MS);
}

refresh();
