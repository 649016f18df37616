// The overview: /api/overview polled every few seconds, its message rates and
// queued messages charted over the last minutes (kept in the page, as
// RabbitMQ's overview does), the object and queue totals, the resource alarms
// (/api/health/checks/alarms) and the cluster's nodes (/api/nodes).
//
// For scripts and tests the DOM carries the data: the status line's
// data-frames (frames drawn) and data-samples (samples charted); each
// total's data-total (its key) and data-value; #alarms' data-count; each
// node row's data-node and data-running; each chart's data-latest (the
// newest sample's values, JSON).
import {el, getJSON, num, rate, bytes, Status} from "./common.js";
import {drawChart} from "./chart.js";

const PERIOD_MS = 5000;
const WINDOW_MS = 10 * 60 * 1000;
const RATES = [
  ["publish", "published", "#2f6fd0"],
  ["confirm", "confirmed", "#8a4fd0"],
  ["deliver_get", "delivered", "#1b7f3b"],
  ["ack", "acknowledged", "#e08a1a"],
];
const DEPTHS = [
  ["messages_ready", "ready", "#2f6fd0"],
  ["messages_unacknowledged", "unacked", "#e08a1a"],
  ["messages", "total", "#555"],
];
const OBJECTS = ["connections", "channels", "exchanges", "queues", "consumers"];

const status = new Status(document.getElementById("status"));
const samples = [];  // {t, rates: {key: per second}, depths: {key: messages}}

function sample(ov) {
  const ms = ov.message_stats || {}, qt = ov.queue_totals || {};
  const s = {t: Date.now(), rates: {}, depths: {}};
  for (const [k] of RATES) s.rates[k] = (ms[`${k}_details`] || {}).rate || 0;
  for (const [k] of DEPTHS) s.depths[k] = qt[k] || 0;
  samples.push(s);
  while (samples.length && samples[0].t < s.t - WINDOW_MS) samples.shift();
}

function chart(id, keys, part, format) {
  const canvas = document.getElementById(id);
  const latest = samples.length ? samples[samples.length - 1][part] : {};
  canvas.dataset.latest = JSON.stringify(latest);
  document.getElementById(`${id}-legend`).replaceChildren(
    ...keys.map(([k, label, color]) => el("span", {}, el("i", {style: `background:${color}`}),
                                          `${label} ${format(latest[k])}`)));
  drawChart(canvas, keys.map(([k, label, color]) => ({label, color, points: samples.map(s => [s.t, s[part][k]])})),
            {windowMs: WINDOW_MS, format});
}

function total(key, label, value) {
  return el("div", {class: "total", "data-total": key, "data-value": String(value ?? "")},
            el("div", {class: "n"}, num(value)), el("div", {class: "what"}, label));
}

function drawTotals(ov) {
  const ot = ov.object_totals || {}, qt = ov.queue_totals || {};
  document.getElementById("totals").replaceChildren(
    ...OBJECTS.map(k => total(k, k, ot[k])),
    ...DEPTHS.map(([k, label]) => total(k, `messages ${label}`, qt[k])));
}

function drawAlarms(health) {
  const alarms = health.alarms || [];
  const box = document.getElementById("alarms");
  box.dataset.count = String(alarms.length);
  box.className = alarms.length ? "bad" : "ok";
  box.replaceChildren(alarms.length
    ? el("ul", {}, ...alarms.map(a => el("li", {}, `${a.resource} alarm on ${a.node}: publishers are blocked`)))
    : "none in effect in the cluster");
}

function nodeAlarms(n) {
  const raised = [n.mem_alarm && "memory", n.disk_free_alarm && "disk"].filter(Boolean);
  return raised.length ? el("span", {class: "bad"}, raised.join(", ")) : el("span", {class: "ok"}, "none");
}

function drawNodes(nodes) {
  document.getElementById("nodes").replaceChildren(...nodes.map(n => {
    const reg = n.registry || {};
    return el("tr", {"data-node": n.name, "data-running": String(n.running)},
              el("td", {}, n.name),
              el("td", {class: n.running ? "ok" : "bad"}, n.running ? "running" : "down"),
              el("td", {}, reg.role || "–"),
              el("td", {class: "num"}, reg.term === undefined || reg.term === null ? "–" : String(reg.term)),
              el("td", {class: "num"}, bytes(n.mem_used)),
              el("td", {class: "num"}, bytes(n.mem_limit)),
              el("td", {class: "num"}, bytes(n.disk_free)),
              el("td", {}, n.running ? nodeAlarms(n) : "–"));
  }));
}

function draw() {
  chart("rates", RATES, "rates", rate);
  chart("depth", DEPTHS, "depths", num);
}

async function refresh() {
  try {
    const [ov, nodes, health] = await Promise.all([
      getJSON("api/overview"), getJSON("api/nodes"), getJSON("api/health/checks/alarms", {}, [503])]);
    sample(ov);
    document.getElementById("cluster").textContent = `· ${ov.cluster_name} (served by ${ov.node})`;
    drawTotals(ov);
    drawAlarms(health);
    drawNodes(nodes);
    draw();
    const up = nodes.filter(n => n.running).length;
    status.node.dataset.samples = String(samples.length);
    status.drawn(`${up} of ${nodes.length} nodes running · ${num((ov.object_totals || {}).queues)} queues`);
  } catch (e) {
    status.failed(e);
  } finally {
    setTimeout(refresh, PERIOD_MS);
  }
}

window.addEventListener("resize", draw);
refresh();
