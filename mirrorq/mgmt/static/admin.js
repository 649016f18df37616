// The admin page: users, virtual hosts, permissions and policies -- each
// listed (users, vhosts and policies paged by the server, listing.js) with a
// Delete / Clear button per row, and a form that adds or changes one, all
// through RabbitMQ's API (PUT / DELETE /api/users, /api/vhosts,
// /api/permissions, /api/policies: the admin layer mirrorctl uses).
//
// For scripts and tests: the forms' data-done ("add user 201"...), each
// row's data-name (users, vhosts, policies "vhost/name") or data-user /
// data-vhost (permissions).
import {el, getJSON, send, seg, Status} from "./common.js";
import {mountListing, inVhost} from "./listing.js";
import {mountForm, jsonField, actionButton} from "./forms.js";

const created = what => (res, v) => res.status === 201 ? `${what} '${v.name}' added` : `${what} '${v.name}' updated`;

const users = mountListing(document.getElementById("users"), {
  path: "api/users",
  key: u => u.name,
  columns: [
    {label: "name", sort: "name", cell: u => u.name},
    {label: "tags", cell: u => (u.tags || []).join(", ")},
    {label: "", cell: u => el("span", {class: "row-actions"}, actionButton("Delete", `Delete user '${u.name}' and its permissions?`,
      () => send("DELETE", `api/users/${seg(u.name)}`), () => { users.refresh(); permissions(); }))},
  ],
});
mountForm(document.getElementById("user-form"), {
  id: "user", what: "put user", submit: "Add / update user",
  fields: [{name: "name", label: "name"}, {name: "password", label: "password", type: "password"},
           {name: "tags", label: "tags (comma-separated)", placeholder: "administrator"}],
  run: v => send("PUT", `api/users/${seg(v.name)}`, v.password ? {password: v.password, tags: v.tags} : {tags: v.tags}),
  done: created("user"),
  after: () => users.refresh(),
});

const vhosts = mountListing(document.getElementById("vhosts"), {
  path: "api/vhosts",
  key: v => v.name,
  columns: [
    {label: "name", sort: "name", cell: v => v.name},
    {label: "description", cell: v => v.description || ""},
    {label: "running on", cell: v => Object.keys(v.cluster_state || {}).join(", ")},
    {label: "", cell: v => v.name === "/" ? "" : el("span", {class: "row-actions"}, actionButton("Delete",
      `Delete virtual host '${v.name}' with everything in it (queues, exchanges, bindings, permissions, policies)?`,
      () => send("DELETE", `api/vhosts/${seg(v.name)}`), () => { vhosts.refresh(); permissions(); }))},
  ],
});
mountForm(document.getElementById("vhost-form"), {
  id: "vhost", what: "put vhost", submit: "Add virtual host",
  fields: [{name: "name", label: "name"}],
  run: v => send("PUT", `api/vhosts/${seg(v.name)}`),
  done: (res, v) => res.status === 201 ? `virtual host '${v.name}' added` : `virtual host '${v.name}' exists already`,
  after: () => vhosts.refresh(),
});

const permStatus = new Status(el("div", {class: "status"}, "loading…"));
const permBody = el("tbody", {});
document.getElementById("permissions").replaceChildren(permStatus.node, el("table", {id: "permissions-table"},
  el("thead", {}, el("tr", {}, ...["user", "vhost", "configure", "write", "read", ""].map(h => el("th", {}, h)))), permBody));

async function permissions() {
  try {
    const rows = await getJSON("api/permissions");
    permBody.replaceChildren(...(rows.length ? rows.map(p => el("tr", {"data-user": p.user, "data-vhost": p.vhost},
      el("td", {}, p.user), el("td", {}, p.vhost), el("td", {}, p.configure), el("td", {}, p.write), el("td", {}, p.read),
      el("td", {class: "row-actions"}, actionButton("Clear", `Clear the permissions of user '${p.user}' in vhost '${p.vhost}'?`,
        () => send("DELETE", `api/permissions/${seg(p.vhost)}/${seg(p.user)}`), permissions))))
      : [el("tr", {}, el("td", {colspan: "6", class: "empty"}, "no permissions"))]));
    permStatus.drawn(`${rows.length} shown`);
  } catch (e) {
    permStatus.failed(e);
  }
}
mountForm(document.getElementById("permission-form"), {
  id: "permission", what: "set permissions", submit: "Set permissions",
  fields: [{name: "user", label: "user"}, {name: "vhost", label: "virtual host", value: "/"},
           {name: "configure", label: "configure regexp", value: ".*"}, {name: "write", label: "write regexp", value: ".*"},
           {name: "read", label: "read regexp", value: ".*"}],
  run: v => send("PUT", `api/permissions/${seg(v.vhost)}/${seg(v.user)}`,
                 {configure: v.configure, write: v.write, read: v.read}),
  done: (res, v) => `permissions of '${v.user}' in '${v.vhost}' set`,
  after: permissions,
});
permissions();
setInterval(permissions, 10000);

const policies = mountListing(document.getElementById("policies"), {
  path: "api/policies",
  key: p => `${p.vhost}/${p.name}`,
  columns: [
    {label: "name", sort: "name", cell: p => inVhost(p.vhost, p.name)},
    {label: "pattern", sort: "pattern", cell: p => p.pattern},
    {label: "apply to", sort: "apply-to", cell: p => p["apply-to"]},
    {label: "definition", cell: p => JSON.stringify(p.definition)},
    {label: "priority", sort: "priority", num: true, cell: p => String(p.priority)},
    {label: "", cell: p => el("span", {class: "row-actions"}, actionButton("Delete", `Delete policy '${p.name}' in vhost '${p.vhost}'?`,
      () => send("DELETE", `api/policies/${seg(p.vhost)}/${seg(p.name)}`), () => policies.refresh()))},
  ],
});
mountForm(document.getElementById("policy-form"), {
  id: "policy", what: "put policy", submit: "Add / update policy",
  fields: [{name: "vhost", label: "virtual host", value: "/"}, {name: "name", label: "name"},
           {name: "pattern", label: "pattern", placeholder: "^orders\\."},
           {name: "apply_to", label: "apply to", type: "select",
            options: [["all", "exchanges and queues"], ["queues", "queues"], ["exchanges", "exchanges"]]},
           {name: "priority", label: "priority", type: "number", value: "0"},
           {name: "definition", label: "definition (JSON)", type: "textarea", placeholder: '{"ha-mode": "all"}'}],
  run: v => send("PUT", `api/policies/${seg(v.vhost)}/${seg(v.name)}`, {pattern: v.pattern, "apply-to": v.apply_to,
    priority: Number(v.priority), definition: jsonField(v.definition, "definition")}),
  done: created("policy"),
  after: () => policies.refresh(),
});
