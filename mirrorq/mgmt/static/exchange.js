// One exchange's page (exchange?vhost=&name=; amq.default: the default
// exchange): its figures polled, the bindings from it (each with an
// Unbind button), the form that binds a queue or an exchange to it, the
// publish form (messages.js), and Delete -- each through RabbitMQ's API as
// the signed-in user.
//
// For scripts and tests: #exchange's data-type (data-missing="true" once it
// is gone); each binding row's data-destination / data-routing-key; the
// forms' data-done; #actions' data-done ("delete 204").
import {el, getJSON, send, seg, ApiError, Status} from "./common.js";
import {link, inVhost} from "./listing.js";
import {mountForm, jsonField, actionButton} from "./forms.js";
import {mountPublish} from "./messages.js";

const PERIOD_MS = 5000;
const params = new URLSearchParams(location.search);
const vhost = params.get("vhost") || "/", name = params.get("name") || "amq.default";
const isDefault = name === "amq.default" || name === "";
const path = `api/exchanges/${seg(vhost)}/${seg(isDefault ? "amq.default" : name)}`;
const status = new Status(document.getElementById("status"));
let timer = null;

document.getElementById("title").textContent = inVhost(vhost, isDefault ? "(AMQP default)" : name);
document.title = `mirrorq · exchange ${name}`;

function drawExchange(x) {
  const box = document.getElementById("exchange");
  Object.assign(box.dataset, {type: x.type, missing: "false"});
  const rows = [["type", x.type], ["durable", String(x.durable)], ["auto delete", String(x.auto_delete)],
                ["internal", String(x.internal)], ["arguments", JSON.stringify(x.arguments || {})],
                ["policy", x.policy || "–"]];
  box.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

function drawBindings(bs) {
  const body = document.querySelector("#bindings tbody");
  body.replaceChildren(...(bs.length ? bs.map(b => {
    const to = b.destination_type === "queue" ? link("queue", {vhost, name: b.destination}, b.destination)
      : link("exchange", {vhost, name: b.destination}, b.destination);
    const kind = b.destination_type === "queue" ? "q" : "e";
    const unbind = isDefault ? "" : actionButton("Unbind", `Unbind ${b.destination_type} '${b.destination}' (routing key '${b.routing_key}') from exchange '${name}'?`,
      () => send("DELETE", `api/bindings/${seg(vhost)}/e/${seg(name)}/${kind}/${seg(b.destination)}/${seg(b.properties_key)}`),
      refresh);
    return el("tr", {"data-destination": b.destination, "data-routing-key": b.routing_key},
              el("td", {}, to), el("td", {}, b.destination_type), el("td", {}, b.routing_key),
              el("td", {}, Object.keys(b.arguments || {}).length ? JSON.stringify(b.arguments) : ""),
              el("td", {class: "row-actions"}, unbind));
  }) : [el("tr", {}, el("td", {colspan: "5", class: "empty"}, "no bindings"))]));
}

async function refresh() {
  clearTimeout(timer);
  try {
    drawExchange(await getJSON(path));
    drawBindings(await getJSON(`${path}/bindings/source`));
    status.drawn("up to date");
  } catch (e) {
    if (e instanceof ApiError && e.status === 404) document.getElementById("exchange").dataset.missing = "true";
    status.failed(e);
  }
  clearTimeout(timer);
  timer = setTimeout(refresh, PERIOD_MS);
}

if (isDefault) {
  document.getElementById("bind-panel").hidden = true;
  document.getElementById("actions").hidden = true;
} else {
  mountForm(document.getElementById("bind"), {
    id: "bind-form", what: "bind", submit: "Bind",
    fields: [
      {name: "kind", label: "to", type: "select", options: [["q", "queue"], ["e", "exchange"]]},
      {name: "destination", label: "name"},
      {name: "routing_key", label: "routing key"},
      {name: "arguments", label: "arguments (JSON)", placeholder: '{"x-match": "all"}'},
    ],
    run: v => send("POST", `api/bindings/${seg(vhost)}/e/${seg(name)}/${v.kind}/${seg(v.destination)}`,
                   {routing_key: v.routing_key, arguments: jsonField(v.arguments, "arguments")}),
    done: (res, v) => `bound ${v.kind === "q" ? "queue" : "exchange"} '${v.destination}'`,
    after: refresh,
  });
  document.querySelector('#actions button[data-action="delete"]').addEventListener("click", async () => {
    if (!confirm(`Delete exchange '${name}' in vhost '${vhost}' with its bindings?`)) return;
    const res = await send("DELETE", path);
    const done = document.getElementById("done");
    document.getElementById("actions").dataset.done = `delete ${res.status}`;
    done.className = res.ok ? "ok" : "bad";
    done.textContent = res.ok ? "deleted" : `delete failed (${res.status}): ${res.reason}`;
    refresh();
  });
}
mountPublish(document.getElementById("publish"), vhost, isDefault ? "" : name, "", refresh);
refresh();
