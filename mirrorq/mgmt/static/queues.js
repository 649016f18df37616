// The queues list: one page of /api/queues at a time, sorted, filtered and
// paged by the server (listing.js), polled every few seconds; the query
// lives in the page's own URL.  Each row carries data-queue / data-vhost /
// data-messages for scripts and tests, its name a link to the queue's page
// (queue?vhost=&name=).
import {el, num, rate} from "./common.js";
import {mountListing} from "./listing.js";

function stat(q, key) {
  const d = (q.message_stats || {})[`${key}_details`];
  return rate(d ? d.rate : null);
}

mountListing(document.getElementById("list"), {
  path: "api/queues",
  url: true,
  noun: "queues",
  key: q => `${q.vhost}/${q.name}`,
  attrs: q => ({"data-queue": q.name, "data-vhost": q.vhost, "data-messages": String(q.messages ?? "")}),
  empty: "no queues match",
  columns: [
    {label: "name", sort: "name", cell: q => el("a", {href: `queue?${new URLSearchParams({vhost: q.vhost, name: q.name})}`},
                                                q.vhost === "/" ? q.name : `${q.vhost}/${q.name}`)},
    {label: "node", sort: "node", cell: q => q.node || "–"},
    {label: "mirrors (synchronised)", cell: q => {
      const mirrors = q.slave_nodes || [], synced = q.synchronised_slave_nodes || [];
      return mirrors.length ? `${mirrors.join(", ")} (${synced.length})` : "–";
    }},
    {label: "state", sort: "state", cell: q => el("span", {class: `state-${q.state}`}, q.state)},
    {label: "ready", sort: "messages_ready", num: true, cell: q => num(q.messages_ready)},
    {label: "unacked", sort: "messages_unacknowledged", num: true, cell: q => num(q.messages_unacknowledged)},
    {label: "total", sort: "messages", num: true, cell: q => num(q.messages)},
    {label: "publish/s", sort: "message_stats.publish_details.rate", num: true, cell: q => stat(q, "publish")},
    {label: "deliver/s", sort: "message_stats.deliver_get_details.rate", num: true, cell: q => stat(q, "deliver_get")},
    {label: "ack/s", sort: "message_stats.ack_details.rate", num: true, cell: q => stat(q, "ack")},
  ],
});
