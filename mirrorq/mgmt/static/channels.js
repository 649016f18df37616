// The channels of every node's client connections: /api/channels paged by the server (listing.js).
import {num} from "./common.js";
import {mountListing} from "./listing.js";

mountListing(document.getElementById("list"), {
  path: "api/channels",
  key: ch => ch.name,
  empty: "no channels",
  columns: [
    {label: "channel", sort: "name", cell: ch => ch.name},
    {label: "node", sort: "node", cell: ch => ch.node},
    {label: "user", sort: "user", cell: ch => ch.user},
    {label: "vhost", sort: "vhost", cell: ch => ch.vhost},
    {label: "mode", cell: ch => [ch.confirm && "confirm", ch.transactional && "transactional"].filter(Boolean).join(", ")},
    {label: "state", sort: "state", cell: ch => ch.state},
    {label: "consumers", sort: "consumer_count", num: true, cell: ch => num(ch.consumer_count)},
    {label: "prefetch", sort: "prefetch_count", num: true, cell: ch => num(ch.prefetch_count)},
    {label: "unacked", sort: "messages_unacknowledged", num: true, cell: ch => num(ch.messages_unacknowledged)},
    {label: "unconfirmed", sort: "messages_unconfirmed", num: true, cell: ch => num(ch.messages_unconfirmed)},
  ],
});
