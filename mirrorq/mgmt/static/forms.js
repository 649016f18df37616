// Small forms and row buttons for the console's create / change / delete actions.
//
// mountForm(box, spec): spec {id, what (its outcome's name), fields: [{name,
// label, type: "text" | "select" | "checkbox" | "textarea" | "number" |
// "password", options: [[value, label]...], value, placeholder}], submit
// (the button's text), run(values) -> a send() result, done(result) -> the
// text shown on success, after()}.  Each input's id is `${spec.id}-${name}`.
// The form's data-done is "<what> <status>" after each answer and its
// outcome line (the API's reason on failure) follows the button.
//
// actionButton(text, ask, run, after): a button that asks `ask` in a confirm
// dialog, then run()s; its data-done is the answer's status, its title the
// API's reason on failure.
import {el, outcome} from "./common.js";

function input(id, f) {
  if (f.type === "select") {
    const s = el("select", {id}, ...f.options.map(([v, label]) => el("option", {value: v}, label)));
    if (f.value !== undefined) s.value = f.value;
    return s;
  }
  if (f.type === "textarea") return el("textarea", {id, rows: "3", placeholder: f.placeholder}, f.value || "");
  if (f.type === "checkbox") {
    const c = el("input", {id, type: "checkbox"});
    c.checked = Boolean(f.value);
    return c;
  }
  return el("input", {id, type: f.type || "text", value: f.value ?? "", placeholder: f.placeholder});
}

export function mountForm(box, spec) {
  const inputs = Object.fromEntries(spec.fields.map(f => [f.name, input(`${spec.id}-${f.name}`, f)]));
  const go = el("button", {type: "submit"}, spec.submit);
  const line = el("span", {class: "outcome"});
  const form = el("form", {id: spec.id, class: "form"},
    ...spec.fields.map(f => el("label", {class: "field"}, el("span", {}, f.label), inputs[f.name])),
    el("div", {class: "controls"}, go, line));
  box.replaceChildren(form);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const values = Object.fromEntries(Object.entries(inputs).map(([k, i]) => [k, i.type === "checkbox" ? i.checked : i.value]));
    go.disabled = true;
    try {
      const res = await spec.run(values);
      outcome(form, line, spec.what, res, spec.done ? spec.done(res, values) : "done");
    } catch (e) {
      outcome(form, line, spec.what, {status: 0, ok: false, reason: e.message}, "");
    }
    go.disabled = false;
    if (spec.after) spec.after();
  });
  return {form, inputs};
}

// JSON typed into a field ("" is {}), or an Error naming the field.
export function jsonField(text, label) {
  try {
    const v = JSON.parse(text.trim() || "{}");
    if (typeof v !== "object" || v === null || Array.isArray(v)) throw new Error("not a JSON object");
    return v;
  } catch (e) {
    throw new Error(`${label}: ${e.message}`);
  }
}

export function actionButton(text, ask, run, after) {
  const b = el("button", {type: "button", class: "row-action"}, text);
  b.addEventListener("click", async () => {
    if (!confirm(ask)) return;
    b.disabled = true;
    try {
      const res = await run();
      b.dataset.done = String(res.status);
      b.title = res.ok ? "" : res.reason;
      if (!res.ok) alert(`${text} failed (${res.status}): ${res.reason}`);
    } catch (e) {
      b.dataset.done = "failed";
      alert(`${text} failed: ${e.message}`);
    }
    b.disabled = false;
    if (after) after();
  });
  return b;
}
