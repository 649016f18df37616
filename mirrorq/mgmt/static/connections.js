// The client connections of every node: /api/connections paged by the server
// (listing.js), each with a Close button (DELETE /api/connections/{name}
// with X-Reason: its client hears 320 CONNECTION_FORCED).
import {el, num, seg, send} from "./common.js";
import {mountListing} from "./listing.js";
import {actionButton} from "./forms.js";

const list = mountListing(document.getElementById("list"), {
  path: "api/connections",
  key: c => c.name,
  empty: "no client connections",
  columns: [
    {label: "name", sort: "name", cell: c => c.name},
    {label: "node", sort: "node", cell: c => c.node},
    {label: "user", sort: "user", cell: c => c.user},
    {label: "vhost", sort: "vhost", cell: c => c.vhost},
    {label: "state", sort: "state", cell: c => c.state},
    {label: "TLS", sort: "ssl", cell: c => c.ssl ? "yes" : "no"},
    {label: "protocol", sort: "protocol", cell: c => c.protocol},
    {label: "channels", sort: "channels", num: true, cell: c => num(c.channels)},
    {label: "client", cell: c => ((c.client_properties || {}).product || "") + " " + ((c.client_properties || {}).version || "")},
    {label: "", cell: c => el("span", {class: "row-actions"}, actionButton("Close",
      `Close connection '${c.name}'? Its client is told 320 CONNECTION_FORCED.`,
      () => send("DELETE", `api/connections/${seg(c.name)}`, undefined,
                 {"X-Reason": "closed from the mirrorq console"}), () => list.refresh()))},
  ],
});
