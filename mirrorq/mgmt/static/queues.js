// The queues list: one page of /api/queues at a time, sorted, filtered and
// paged by the server (mirrorq/mgmt/paging.py), polled every few seconds.
//
// The page's query (page, page_size, name, use_regex, sort, sort_reverse)
// is the API's and lives in the page's own URL, so a view can be linked and
// reloaded.  Clicking a column's header sorts by it (again: reversed).  For
// scripts and tests the table carries the answer: data-page, data-page-count,
// data-item-count, data-filtered-count, data-total-count and data-query (the
// query it answers); each row data-queue / data-vhost / data-messages, its
// name a link to the queue's page (queue?vhost=&name=).
import {el, getJSON, num, rate, ApiError, Status} from "./common.js";

const PERIOD_MS = 5000;
const COLUMNS = 10;
const DEFAULTS = {page: "1", page_size: "20", name: "", use_regex: "false", sort: "name", sort_reverse: "false"};

const status = new Status(document.getElementById("status"));
const query = {...DEFAULTS};
for (const k of Object.keys(DEFAULTS)) {
  const v = new URLSearchParams(location.search).get(k);
  if (v !== null) query[k] = v;
}
let timer = null;
let pageCount = 1;

function stat(q, key) {
  const d = (q.message_stats || {})[`${key}_details`];
  return rate(d ? d.rate : null);
}

function row(q) {
  const mirrors = q.slave_nodes || [], synced = q.synchronised_slave_nodes || [];
  return el("tr", {"data-queue": q.name, "data-vhost": q.vhost, "data-messages": String(q.messages ?? "")},
            el("td", {}, el("a", {href: `queue?${new URLSearchParams({vhost: q.vhost, name: q.name})}`},
                            q.vhost === "/" ? q.name : `${q.vhost}/${q.name}`)),
            el("td", {}, q.node || "–"),
            el("td", {}, mirrors.length ? `${mirrors.join(", ")} (${synced.length})` : "–"),
            el("td", {class: `state-${q.state}`}, q.state),
            el("td", {class: "num"}, num(q.messages_ready)),
            el("td", {class: "num"}, num(q.messages_unacknowledged)),
            el("td", {class: "num"}, num(q.messages)),
            el("td", {class: "num"}, stat(q, "publish")),
            el("td", {class: "num"}, stat(q, "deliver_get")),
            el("td", {class: "num"}, stat(q, "ack")));
}

function drawHeaders() {
  for (const th of document.querySelectorAll("th[data-sort]")) {
    th.querySelector(".arrow")?.remove();
    if (th.dataset.sort === query.sort) th.append(el("span", {class: "arrow"}, query.sort_reverse === "true" ? " ▼" : " ▲"));
  }
}

function draw(p, asked) {
  const table = document.getElementById("table");
  Object.assign(table.dataset, {page: p.page, pageCount: p.page_count, itemCount: p.item_count,
                                filteredCount: p.filtered_count, totalCount: p.total_count, query: asked});
  pageCount = Math.max(p.page_count, 1);
  document.getElementById("queues").replaceChildren(...(p.items.length ? p.items.map(row)
    : [el("tr", {}, el("td", {colspan: String(COLUMNS), class: "empty"}, "no queues match"))]));
  document.getElementById("pageinfo").textContent = `page ${p.page} of ${pageCount}`;
  document.getElementById("counts").textContent = p.filtered_count === p.total_count
    ? `${num(p.total_count)} queues` : `${num(p.filtered_count)} of ${num(p.total_count)} queues match`;
  for (const [id, off] of [["first", p.page <= 1], ["prev", p.page <= 1], ["next", p.page >= pageCount],
                           ["last", p.page >= pageCount]]) {
    document.getElementById(id).disabled = off;
  }
  drawHeaders();
  status.drawn(`${p.item_count} shown`);
}

async function refresh() {
  clearTimeout(timer);
  const asked = new URLSearchParams(query).toString();
  try {
    const p = await getJSON("api/queues", query);
    if (asked === new URLSearchParams(query).toString()) draw(p, asked);  // else a newer query is on its way
  } catch (e) {
    if (e instanceof ApiError && e.status === 400 && e.reason.startsWith("page:") && query.page !== "1") {
      set({page: "1"});  // the list got shorter than the page we were on
      return;
    }
    status.failed(e);
  }
  clearTimeout(timer);  // one polling loop, however many refreshes were in flight
  timer = setTimeout(refresh, PERIOD_MS);
}

// change the query: into the page's URL, and ask now
function set(changes) {
  Object.assign(query, changes);
  const shown = Object.fromEntries(Object.entries(query).filter(([k, v]) => DEFAULTS[k] !== v));
  const search = new URLSearchParams(shown).toString();
  history.replaceState(null, "", search ? `?${search}` : location.pathname);
  refresh();
}

const name = document.getElementById("name"), regex = document.getElementById("use_regex");
const size = document.getElementById("page_size");
name.value = query.name;
regex.checked = query.use_regex === "true";
if (![...size.options].some(o => o.value === query.page_size)) size.append(el("option", {}, query.page_size));
size.value = query.page_size;
let typing = null;
name.addEventListener("input", () => {
  clearTimeout(typing);
  typing = setTimeout(() => set({name: name.value, page: "1"}), 300);
});
regex.addEventListener("change", () => set({use_regex: String(regex.checked), page: "1"}));
size.addEventListener("change", () => set({page_size: size.value, page: "1"}));
document.getElementById("first").addEventListener("click", () => set({page: "1"}));
document.getElementById("prev").addEventListener("click", () => set({page: String(Math.max(1, Number(query.page) - 1))}));
document.getElementById("next").addEventListener("click", () => set({page: String(Math.min(pageCount, Number(query.page) + 1))}));
document.getElementById("last").addEventListener("click", () => set({page: String(pageCount)}));
for (const th of document.querySelectorAll("th[data-sort]")) {
  th.addEventListener("click", () => {
    const again = query.sort === th.dataset.sort;
    set({sort: th.dataset.sort, sort_reverse: String(again ? query.sort_reverse !== "true" : false), page: "1"});
  });
}
refresh();
