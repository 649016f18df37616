// What the console pages share: building elements, the API's URLs and JSON, the status line.

// a request that has not answered by then is given up (and retried): the
// server's own reads time out well before (registry 10 s, queue masters 5 s)
export const REQUEST_TIMEOUT_MS = 20000;

export function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

// An API path relative to the page (the page may be served under a prefix);
// from the page's origin and path: a page opened as http://user:pw@host/ may not fetch a URL with credentials.
export function apiURL(path, params) {
  const url = new URL(path, location.origin + location.pathname);
  for (const [k, v] of Object.entries(params || {})) url.searchParams.set(k, String(v));
  return url;
}

export class ApiError extends Error {
  constructor(status, reason) {
    super(`${status} ${reason}`);
    this.status = status;
    this.reason = reason;
  }
}

// The JSON answer of a GET; `accept`: statuses whose JSON is an answer too (a failed health check's 503).
export async function getJSON(path, params, accept = []) {
  const resp = await fetch(apiURL(path, params), {credentials: "same-origin", cache: "no-store",
                                                  signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS)});
  if (!resp.ok && !accept.includes(resp.status)) {
    const body = await resp.json().catch(() => ({}));
    throw new ApiError(resp.status, body.reason || resp.statusText);
  }
  return resp.json();
}

export function num(v) {
  return v === null || v === undefined ? "?" : Number(v).toLocaleString("en");
}

export function rate(v) {
  return v === null || v === undefined ? "–" : Number(v).toFixed(1);
}

export function bytes(v) {
  if (v === null || v === undefined) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
}

// The status line: frames drawn so far in data-frames, the error of the last attempt if it failed.
export class Status {
  constructor(node) {
    this.node = node;
    this.base = node.className;
    this.frames = 0;
  }
  drawn(text) {
    this.frames += 1;
    this.node.dataset.frames = String(this.frames);
    this.node.className = this.base;
    this.node.textContent = `${text} · updated ${new Date().toLocaleTimeString()}`;
  }
  failed(e) {
    this.node.className = `${this.base} error`.trim();
    this.node.textContent = `update failed: ${e.message} (retrying)`;
  }
}

// A request that changes something: {status, ok, body (JSON or null), reason (the API's, when not ok)}.
export async function send(method, path, body, headers = {}) {
  const resp = await fetch(apiURL(path), {method, credentials: "same-origin", cache: "no-store",
    headers: body === undefined ? headers : {...headers, "Content-Type": "application/json"},
    body: body === undefined ? undefined : JSON.stringify(body), signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS)});
  const json = await resp.json().catch(() => null);
  return {status: resp.status, ok: resp.ok, body: json,
          reason: resp.ok ? "" : ((json && json.reason) || resp.statusText)};
}

// A form's outcome line: its text, and data-done on the form ("<what> <status>") for scripts and tests.
export function outcome(form, line, what, res, text) {
  form.dataset.done = `${what} ${res.status}`;
  line.className = res.ok ? "ok" : "bad";
  line.textContent = res.ok ? text : `${what} failed (${res.status}): ${res.reason}`;
}

// The segment of an API path for a vhost or a name ("/" is %2F).
export const seg = encodeURIComponent;

// A node's uptime (ms) as days/hours/minutes.
export function uptime(ms) {
  if (ms === null || ms === undefined) return "–";
  const s = Math.floor(ms / 1000), d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600);
  const m = Math.floor(s % 3600 / 60);
  return d ? `${d}d ${h}h` : h ? `${h}h ${m}m` : m ? `${m}m ${s % 60}s` : `${s}s`;
}

// A node's own resource alarms, or "none".
export function alarmsCell(n) {
  if (!n.running) return "–";
  const a = n.alarms || [];
  return a.length ? el("span", {class: "bad"}, a.join(", ")) : el("span", {class: "ok"}, "none");
}
