// A listing of the API as a table paged, sorted and filtered by the server
// (mirrorq/mgmt/paging.py: page, page_size, name, use_regex, sort,
// sort_reverse), polled every few seconds -- for the queues, exchanges,
// connections, channels, users, vhosts and policies pages.
//
// mountListing(root, spec) builds, inside `root`: a filter, a page size, a
// pager and the table.  spec: {path (the API listing), columns: [{label,
// sort (a field, dotted), num, cell(o) -> text or element}], key(o) (the
// row's data-name), attrs(o) (more attributes of a row), empty (text when
// nothing matches), noun (what the counts count), period (ms), url (the
// query lives in the page's own URL, so a view can be linked and reloaded)}.
// For scripts and tests: the table's data-page, data-page-count,
// data-item-count, data-filtered-count, data-total-count, data-query; each
// row's data-name.  Returns {refresh()}.
import {el, getJSON, num, ApiError, Status} from "./common.js";

export function mountListing(root, spec) {
  const defaults = {page: "1", page_size: "20", name: "", use_regex: "false", sort: spec.sort || "name",
                    sort_reverse: "false"};
  const query = {...defaults};
  if (spec.url) {
    for (const k of Object.keys(defaults)) {
      const v = new URLSearchParams(location.search).get(k);
      if (v !== null) query[k] = v;
    }
  }
  const status = new Status(el("div", {class: "status"}, "loading…"));
  const name = el("input", {type: "search", class: "filter", placeholder: "name contains…", autocomplete: "off"});
  const regex = el("input", {type: "checkbox", class: "regex"});
  const size = el("select", {class: "page-size"}, ...["20", "50", "100", "500"].map(n => el("option", {}, n)));
  const btn = (cls, text, title) => el("button", {class: cls, title, type: "button"}, text);
  const first = btn("first", "«", "first page"), prev = btn("prev", "‹", "previous page");
  const next = btn("next", "›", "next page"), last = btn("last", "»", "last page");
  const info = el("span", {class: "pageinfo"}), counts = el("span", {class: "counts"});
  const heads = spec.columns.map(c => el("th", {class: c.num ? "num" : undefined, "data-sort": c.sort}, c.label));
  const tbody = el("tbody", {}, el("tr", {}, el("td", {colspan: String(spec.columns.length), class: "empty"}, "no data yet")));
  const table = el("table", {class: "listing"}, el("thead", {}, el("tr", {}, ...heads)), tbody);
  name.value = query.name;
  regex.checked = query.use_regex === "true";
  if (![...size.options].some(o => o.value === query.page_size)) size.append(el("option", {}, query.page_size));
  size.value = query.page_size;
  root.replaceChildren(status.node,
    el("div", {class: "controls"}, el("label", {}, "filter ", name), el("label", {}, regex, " regex"),
       el("label", {}, "per page ", size), el("span", {class: "pager"}, first, prev, info, next, last), counts),
    table);
  let timer = null, pageCount = 1;

  function draw(p, asked) {
    Object.assign(table.dataset, {page: p.page, pageCount: p.page_count, itemCount: p.item_count,
                                  filteredCount: p.filtered_count, totalCount: p.total_count, query: asked});
    pageCount = Math.max(p.page_count, 1);
    tbody.replaceChildren(...(p.items.length
      ? p.items.map(o => el("tr", {"data-name": spec.key(o), ...(spec.attrs ? spec.attrs(o) : {})}, ...spec.columns.map(c =>
          el("td", {class: c.num ? "num" : undefined}, c.cell(o) ?? "–"))))
      : [el("tr", {}, el("td", {colspan: String(spec.columns.length), class: "empty"}, spec.empty || "none"))]));
    info.textContent = `page ${p.page} of ${pageCount}`;
    const noun = spec.noun ? ` ${spec.noun}` : "";
    counts.textContent = p.filtered_count === p.total_count ? `${num(p.total_count)}${noun || " in all"}`
      : `${num(p.filtered_count)} of ${num(p.total_count)}${noun} match`;
    for (const [b, off] of [[first, p.page <= 1], [prev, p.page <= 1], [next, p.page >= pageCount],
                            [last, p.page >= pageCount]]) b.disabled = off;
    for (const th of heads) {
      th.querySelector(".arrow")?.remove();
      if (th.dataset.sort && th.dataset.sort === query.sort) {
        th.append(el("span", {class: "arrow"}, query.sort_reverse === "true" ? " ▼" : " ▲"));
      }
    }
    status.drawn(`${p.item_count} shown`);
  }

  async function refresh() {
    clearTimeout(timer);
    const asked = new URLSearchParams(query).toString();
    try {
      const p = await getJSON(spec.path, query);
      if (asked === new URLSearchParams(query).toString()) draw(p, asked);
    } catch (e) {
      if (e instanceof ApiError && e.status === 400 && e.reason.startsWith("page:") && query.page !== "1") {
        set({page: "1"});
        return;
      }
      status.failed(e);
    }
    clearTimeout(timer);
    timer = setTimeout(refresh, spec.period || 5000);
  }

  // change the query (into the page's URL with spec.url) and ask now
  function set(changes) {
    Object.assign(query, changes);
    if (spec.url) {
      const shown = Object.fromEntries(Object.entries(query).filter(([k, v]) => defaults[k] !== v));
      const search = new URLSearchParams(shown).toString();
      history.replaceState(null, "", search ? `?${search}` : location.pathname);
    }
    refresh();
  }

  let typing = null;
  name.addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(() => set({name: name.value, page: "1"}), 300);
  });
  regex.addEventListener("change", () => set({use_regex: String(regex.checked), page: "1"}));
  size.addEventListener("change", () => set({page_size: size.value, page: "1"}));
  first.addEventListener("click", () => set({page: "1"}));
  prev.addEventListener("click", () => set({page: String(Math.max(1, Number(query.page) - 1))}));
  next.addEventListener("click", () => set({page: String(Math.min(pageCount, Number(query.page) + 1))}));
  last.addEventListener("click", () => set({page: String(pageCount)}));
  for (const th of heads) {
    if (!th.dataset.sort) continue;
    th.addEventListener("click", () => {
      const again = query.sort === th.dataset.sort;
      set({sort: th.dataset.sort, sort_reverse: String(again ? query.sort_reverse !== "true" : false), page: "1"});
    });
  }
  refresh();
  return {refresh};
}

// A link to a console page with query parameters.
export function link(page, params, text) {
  return el("a", {href: `${page}?${new URLSearchParams(params)}`}, text);
}

// "name" shown with its vhost unless it is the default one.
export function inVhost(vhost, name) {
  return vhost === "/" ? name : `${vhost}/${name}`;
}
