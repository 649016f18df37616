// The get-messages and publish forms (a queue's page, an exchange's page):
// RabbitMQ's POST /api/queues/{vhost}/{name}/get and
// POST /api/exchanges/{vhost}/{name}/publish.
//
// For scripts and tests: each form's data-done ("get 200", "publish 400"...);
// #got's data-count and each message's data-payload / data-redelivered;
// the publish form's data-routed ("true" / "false") after a publish.
import {el, send, outcome, seg} from "./common.js";

const ACKMODES = [
  ["ack_requeue_true", "Nack message requeue true"],
  ["reject_requeue_true", "Reject requeue true"],
  ["ack_requeue_false", "Automatic ack"],
  ["reject_requeue_false", "Reject requeue false"],
];

function field(label, input) {
  return el("label", {class: "field"}, el("span", {}, label), input);
}

function select(id, options) {
  return el("select", {id}, ...options.map(([v, label]) => el("option", {value: v}, label)));
}

// The get form into `box`, for queue `name` of `vhost`; `after()` runs once a get answered.
export function mountGet(box, vhost, name, after) {
  const count = el("input", {id: "get-count", type: "number", min: "1", value: "1"});
  const ackmode = select("get-ackmode", ACKMODES);
  const encoding = select("get-encoding", [["auto", "Auto string / base64"], ["base64", "base64"]]);
  const truncate = el("input", {id: "get-truncate", type: "number", min: "0", value: "50000"});
  const go = el("button", {type: "submit"}, "Get messages");
  const line = el("span", {id: "get-done"});
  const got = el("div", {id: "got"});
  const form = el("form", {id: "get-form", class: "form"},
                  field("messages", count), field("ack mode", ackmode), field("encoding", encoding),
                  field("truncate (bytes)", truncate), el("div", {class: "controls"}, go, line));
  box.replaceChildren(form, got);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    go.disabled = true;
    try {
      const body = {count: count.value, ackmode: ackmode.value, encoding: encoding.value, truncate: truncate.value};
      const res = await send("POST", `api/queues/${seg(vhost)}/${seg(name)}/get`, body);
      const msgs = res.ok ? res.body : [];
      outcome(form, line, "get", res, msgs.length ? `${msgs.length} message(s) got` : "the queue is empty");
      got.dataset.count = String(msgs.length);
      got.replaceChildren(...msgs.map((m, i) => el("table", {class: "message", "data-payload": m.payload,
                                                               "data-redelivered": String(m.redelivered)},
        el("caption", {}, `message ${i + 1}`),
        ...[["exchange", m.exchange || "(AMQP default)"], ["routing key", m.routing_key],
            ["redelivered", String(m.redelivered)], ["left in queue", String(m.message_count)],
            ["properties", JSON.stringify(m.properties)],
            ["payload", `${m.payload_bytes} bytes, ${m.payload_encoding}`]]
          .map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v))),
        el("tr", {}, el("td", {colspan: "2"}, el("pre", {}, m.payload))))));
    } catch (e) {
      outcome(form, line, "get", {status: 0, ok: false, reason: e.message}, "");
    }
    go.disabled = false;
    if (after) after();
  });
}

// The publish form into `box`, to `exchange` ("" or amq.default: the default one) of `vhost`.
export function mountPublish(box, vhost, exchange, routingKey, after) {
  const rk = el("input", {id: "pub-routing-key", value: routingKey || ""});
  const mode = select("pub-delivery-mode", [["2", "2 - persistent"], ["1", "1 - non-persistent"]]);
  const headers = el("input", {id: "pub-headers", placeholder: '{"key": "value"}'});
  const props = el("input", {id: "pub-properties", placeholder: '{"content_type": "text/plain"}'});
  const payload = el("textarea", {id: "pub-payload", rows: "4"});
  const encoding = select("pub-encoding", [["string", "string"], ["base64", "base64"]]);
  const go = el("button", {type: "submit"}, "Publish message");
  const line = el("span", {id: "pub-done"});
  const form = el("form", {id: "publish-form", class: "form"},
                  field("routing key", rk), field("delivery mode", mode), field("headers (JSON)", headers),
                  field("properties (JSON)", props), field("payload", payload), field("payload encoding", encoding),
                  el("div", {class: "controls"}, go, line));
  box.replaceChildren(form);
  const xname = exchange === "" ? "amq.default" : exchange;
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    let properties;
    try {
      properties = JSON.parse(props.value.trim() || "{}");
      const h = JSON.parse(headers.value.trim() || "{}");
      if (Object.keys(h).length) properties.headers = h;
    } catch (e) {
      outcome(form, line, "publish", {status: 0, ok: false, reason: `the headers or properties are not JSON: ${e.message}`}, "");
      return;
    }
    properties.delivery_mode = Number(mode.value);
    go.disabled = true;
    try {
      const res = await send("POST", `api/exchanges/${seg(vhost)}/${seg(xname)}/publish`,
                             {routing_key: rk.value, properties, payload: payload.value, payload_encoding: encoding.value});
      if (res.ok) form.dataset.routed = String(res.body.routed);
      outcome(form, line, "publish", res, res.ok && res.body.routed ? "Message published."
        : "Message published, but not routed (no queue bound for that routing key).");
    } catch (e) {
      outcome(form, line, "publish", {status: 0, ok: false, reason: e.message}, "");
    }
    go.disabled = false;
    if (after) after();
  });
}
