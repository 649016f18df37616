// The exchanges: /api/exchanges paged by the server (listing.js), each name a
// link to its page (exchange?vhost=&name=); and the form that declares one
// (PUT /api/exchanges/{vhost}/{name}, as the signed-in user).
import {send, seg} from "./common.js";
import {mountListing, link, inVhost} from "./listing.js";
import {mountForm, jsonField} from "./forms.js";

const list = mountListing(document.getElementById("list"), {
  path: "api/exchanges",
  key: x => `${x.vhost}/${x.name}`,
  empty: "no exchanges match",
  columns: [
    {label: "name", sort: "name", cell: x => link("exchange", {vhost: x.vhost, name: x.name || "amq.default"},
                                                  inVhost(x.vhost, x.name || "(AMQP default)"))},
    {label: "type", sort: "type", cell: x => x.type},
    {label: "durable", sort: "durable", cell: x => String(x.durable)},
    {label: "auto delete", sort: "auto_delete", cell: x => String(x.auto_delete)},
    {label: "internal", sort: "internal", cell: x => String(x.internal)},
    {label: "arguments", cell: x => Object.keys(x.arguments || {}).length ? JSON.stringify(x.arguments) : ""},
    {label: "policy", sort: "policy", cell: x => x.policy || ""},
  ],
});

mountForm(document.getElementById("add"), {
  id: "add-exchange", what: "add exchange", submit: "Add exchange",
  fields: [
    {name: "vhost", label: "virtual host", value: "/"},
    {name: "name", label: "name"},
    {name: "type", label: "type", type: "select", options: ["direct", "fanout", "topic", "headers"].map(t => [t, t])},
    {name: "durable", label: "durable", type: "checkbox", value: true},
    {name: "auto_delete", label: "auto delete", type: "checkbox", value: false},
    {name: "internal", label: "internal", type: "checkbox", value: false},
    {name: "arguments", label: "arguments (JSON)", placeholder: '{"alternate-exchange": "ae"}'},
  ],
  run: v => send("PUT", `api/exchanges/${seg(v.vhost)}/${seg(v.name)}`, {
    type: v.type, durable: v.durable, auto_delete: v.auto_delete, internal: v.internal,
    arguments: jsonField(v.arguments, "arguments")}),
  done: (res, v) => res.status === 201 ? `exchange '${v.name}' added` : `exchange '${v.name}' exists already (kept)`,
  after: () => list.refresh(),
});
