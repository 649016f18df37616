"""The admin layer's operations run as the asking user over AMQP: get, publish, exchanges, bindings.

RabbitMQ's management API gets messages from a queue
(``POST /api/queues/{vhost}/{name}/get``), publishes to an exchange
(``POST /api/exchanges/{vhost}/{name}/publish``), declares and deletes
exchanges and binds and unbinds through a channel of its own; here they run
as an AMQP conversation with a node's listener, as the user who asked
(:class:`mirrorq.amqp.client.BlockingClient`), so the user's permissions,
the queues' semantics, the routing and the topology's checks are the
broker's own.

Exchanges and bindings (:func:`parse_exchange`, :func:`declare_exchange`,
:func:`delete_exchange`, :func:`parse_binding`, :func:`bind`,
:func:`unbind`): ``exchange.declare`` (``type`` required; ``durable``
true, ``auto_delete`` and ``internal`` false, ``arguments`` {} by default;
an existing one not equivalent: the broker's 406, a 400), ``exchange.delete``
(``if_unused``), ``queue.bind`` / ``exchange.bind`` and their unbinds with
``routing_key`` and ``arguments``.

Get (:func:`parse_get`, :func:`get_messages`), RabbitMQ's semantics:

* ``count`` (1..:data:`MAX_GET_COUNT`), ``ackmode``, ``encoding`` are required,
  ``truncate`` is optional (bytes of each payload shown);
* ``ackmode``: ``ack_requeue_false`` gets with ``no_ack`` (the messages are
  gone); ``reject_requeue_true`` / ``reject_requeue_false`` get with acks
  and reject every message got, requeueing it or not (dead-lettering it
  where the queue says so), after the last get -- a requeued message would
  otherwise be got again; ``ack_requeue_true`` gets with acks and closes
  the channel, which requeues them (they come back ``redelivered``);
* the gets stop at the first ``get-empty``, or once the payloads got reach
  :data:`MAX_GET_BYTES` (the answer then holds fewer messages than asked);
* each message is ``{payload_bytes, redelivered, exchange, routing_key,
  message_count, properties, payload, payload_encoding}``: ``encoding``
  ``auto`` gives the payload as text when it is UTF-8 (``string``), else
  base64; ``base64`` always base64; ``truncate`` cuts the payload (not
  ``payload_bytes``) first.

Publish (:func:`parse_publish`, :func:`publish_message`): ``routing_key``,
``properties``, ``payload`` and ``payload_encoding`` (``string`` |
``base64``) are required; the message is published ``mandatory`` with
publisher confirms: the answer is whether it was routed to a queue.  The
exchange ``amq.default`` is the default exchange ("").

Bad input is :class:`~mirrorq.admin.cluster.Invalid` naming the field; the
broker's refusals are mapped as RabbitMQ's API maps them: 404 NOT_FOUND
(no queue, no exchange) :class:`~mirrorq.admin.cluster.NotFound`, 403
ACCESS_REFUSED or a refused login or vhost
:class:`~mirrorq.admin.cluster.AccessRefused`, any other
channel or connection error :class:`~mirrorq.admin.cluster.Invalid` with
the broker's text; no answer by the deadline
:class:`~mirrorq.admin.cluster.CommandTimeout`, no connection
:class:`~mirrorq.admin.cluster.NodeUnavailable`.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pamqp import commands as C

from mirrorq.admin.cluster import AccessRefused, ClusterError, CommandTimeout, Invalid, NodeUnavailable, NotFound
from mirrorq.amqp.client import AmqpError, AmqpTimeout, BlockingClient
from mirrorq.amqp.topology import EXCHANGE_TYPES

#: what the conversations call their connections (/api/connections shows them while they run)
CONNECTION_NAME = "mirrorq management"

ACKMODES = ("ack_requeue_true", "reject_requeue_true", "ack_requeue_false", "reject_requeue_false")
ENCODINGS = ("auto", "base64")
PAYLOAD_ENCODINGS = ("string", "base64")
#: the most messages one get answers
MAX_GET_COUNT = 1000
#: the gets stop once the payloads got reach this many bytes
MAX_GET_BYTES = 64 * 2**20
#: RabbitMQ's message property names, and pamqp's attribute for each
PROPERTIES = {
    "content_type": "content_type",
    "content_encoding": "content_encoding",
    "headers": "headers",
    "delivery_mode": "delivery_mode",
    "priority": "priority",
    "correlation_id": "correlation_id",
    "reply_to": "reply_to",
    "expiration": "expiration",
    "message_id": "message_id",
    "timestamp": "timestamp",
    "type": "message_type",
    "user_id": "user_id",
    "app_id": "app_id",
    "cluster_id": "cluster_id",
}
_SHORTSTR = 255


@dataclass(frozen=True)
class GetRequest:
    count: int
    ackmode: str
    encoding: str
    truncate: int | None


@dataclass(frozen=True)
class PublishRequest:
    routing_key: str
    payload: bytes
    properties: C.Basic.Properties


def _required(body: Mapping[str, Any], key: str, hint: str) -> Any:
    if key not in body:
        raise Invalid(f"{key}: missing ({hint})")
    return body[key]


def _whole(value: Any, key: str, low: int, high: int | None) -> int:
    """An int from a JSON number or a decimal string (RabbitMQ's forms send strings)."""
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and value.strip().isdigit():
        n = int(value)
    if n is None or n < low or (high is not None and n > high):
        span = f"{low}..{high}" if high is not None else f"at least {low}"
        raise Invalid(f"{key}: must be a whole number {span}, got {value!r}")
    return n


def parse_get(body: Mapping[str, Any]) -> GetRequest:
    """A get request's body (``count``, ``ackmode``, ``encoding``, ``truncate``), or Invalid naming the field."""
    count = _whole(_required(body, "count", f"1..{MAX_GET_COUNT}"), "count", 1, MAX_GET_COUNT)
    ackmode = _required(body, "ackmode", " | ".join(ACKMODES))
    if ackmode not in ACKMODES:
        raise Invalid(f"ackmode: must be one of {', '.join(ACKMODES)}, got {ackmode!r}")
    encoding = _required(body, "encoding", " | ".join(ENCODINGS))
    if encoding not in ENCODINGS:
        raise Invalid(f"encoding: must be auto or base64, got {encoding!r}")
    raw = body.get("truncate")
    truncate = None if raw in (None, "") else _whole(raw, "truncate", 0, None)
    return GetRequest(count, ackmode, encoding, truncate)


def _header_value(key: str, v: Any) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list):
        return [_header_value(key, x) for x in v]
    if isinstance(v, dict):
        return {str(k): _header_value(key, x) for k, x in v.items()}
    raise Invalid(f"properties.headers.{key}: a {type(v).__name__} is not an AMQP field value")


def to_properties(props: Any) -> C.Basic.Properties:
    """RabbitMQ's JSON message properties as pamqp's, or Invalid naming the property."""
    if not isinstance(props, dict):
        raise Invalid(f"properties: must be a JSON object, got {props!r}")
    out: dict[str, Any] = {}
    for key, value in props.items():
        if key not in PROPERTIES:
            raise Invalid(f"properties.{key}: not a message property (one of {', '.join(PROPERTIES)})")
        if value is None:
            continue
        if key == "headers":
            if not isinstance(value, dict):
                raise Invalid(f"properties.headers: must be a JSON object, got {value!r}")
            value = {str(k): _header_value(str(k), v) for k, v in value.items()}
        elif key == "delivery_mode":
            value = _whole(value, "properties.delivery_mode", 1, 2)
        elif key == "priority":
            value = _whole(value, "properties.priority", 0, 255)
        elif key == "timestamp":
            secs = _whole(value, "properties.timestamp", 0, None)
            value = datetime.datetime.fromtimestamp(secs, datetime.UTC)
        elif key == "expiration" and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if key not in ("headers", "delivery_mode", "priority", "timestamp"):
            if not isinstance(value, str) or len(value.encode()) > _SHORTSTR:
                raise Invalid(f"properties.{key}: must be a string of at most {_SHORTSTR} bytes, got {value!r}")
        out[PROPERTIES[key]] = value
    return C.Basic.Properties(**out)


def _json_value(v: Any) -> Any:
    if isinstance(v, bytes | bytearray):
        return bytes(v).decode("utf-8", errors="replace")
    if isinstance(v, datetime.datetime):
        return int(v.replace(tzinfo=v.tzinfo or datetime.UTC).timestamp())
    if isinstance(v, list):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_value(x) for k, x in v.items()}
    return v


def properties_json(props: C.Basic.Properties | None) -> dict:
    """pamqp's message properties as RabbitMQ's JSON: only those present."""
    if props is None:
        return {}
    out = {}
    for key, attr in PROPERTIES.items():
        v = getattr(props, attr, None)
        if v is None or v == "" and key == "cluster_id":
            continue
        out[key] = _json_value(v)
    return out


def parse_publish(body: Mapping[str, Any]) -> PublishRequest:
    """A publish request's body, or Invalid naming the field."""
    routing_key = _required(body, "routing_key", "a string, may be empty")
    if not isinstance(routing_key, str) or len(routing_key.encode()) > _SHORTSTR:
        raise Invalid(f"routing_key: must be a string of at most {_SHORTSTR} bytes, got {routing_key!r}")
    props = to_properties(_required(body, "properties", "an object, may be empty"))
    payload = _required(body, "payload", "a string")
    if not isinstance(payload, str):
        raise Invalid(f"payload: must be a string, got {type(payload).__name__}")
    encoding = _required(body, "payload_encoding", "string | base64")
    if encoding == "string":
        data = payload.encode()
    elif encoding == "base64":
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise Invalid("payload: is not base64 (payload_encoding is base64)") from None
    else:
        raise Invalid(f"payload_encoding: must be string or base64, got {encoding!r}")
    return PublishRequest(routing_key, data, props)


def message_json(got: Any, encoding: str, truncate: int | None) -> dict:
    """One got message as RabbitMQ's get answer shows it."""
    body: bytes = got.body
    shown = body if truncate is None else body[:truncate]
    text: str | None = None
    if encoding == "auto":
        try:
            text = shown.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    return {
        "payload_bytes": len(body),
        "redelivered": got.redelivered,
        "exchange": got.exchange,
        "routing_key": got.routing_key,
        "message_count": got.message_count,
        "properties": properties_json(got.properties),
        "payload": text if text is not None else base64.b64encode(shown).decode(),
        "payload_encoding": "string" if text is not None else "base64",
    }


def _conversation(address: tuple[str, int], user: str, password: str, vhost: str, timeout: float) -> BlockingClient:
    """A connection to ``address`` as ``user`` on ``vhost``, every wait of it within ``timeout``."""
    host, port = address
    return BlockingClient(
        host, port, user, password, vhost, time.monotonic() + timeout, connection_name=CONNECTION_NAME
    )


def _mapped(e: AmqpError, what: str) -> ClusterError:
    if isinstance(e, AmqpTimeout):
        return CommandTimeout(f"{what}: {e.text}")
    if e.code == 404:
        return NotFound(e.text)
    if e.code in (403, 530):
        return AccessRefused(e.text)
    if e.code == 0:
        return NodeUnavailable(f"{what}: {e.text}")
    return Invalid(e.text)


def get_messages(
    address: tuple[str, int], user: str, password: str, vhost: str, queue: str, req: GetRequest, timeout: float
) -> list[dict]:
    """Up to ``req.count`` messages of ``queue``, handled as ``req.ackmode`` says."""
    what = f"get from queue '{queue}' in vhost '{vhost}'"
    out: list[dict] = []
    try:
        with _conversation(address, user, password, vhost, timeout) as c:
            no_ack = req.ackmode == "ack_requeue_false"
            tags: list[int] = []
            got_bytes = 0
            while len(out) < req.count and got_bytes < MAX_GET_BYTES:
                got = c.get(queue, no_ack)
                if got is None:
                    break
                tags.append(got.delivery_tag)
                got_bytes += len(got.body)
                out.append(message_json(got, req.encoding, req.truncate))
            if req.ackmode.startswith("reject_"):
                for tag in tags:
                    c.reject(tag, requeue=req.ackmode == "reject_requeue_true")
            # ack_requeue_true: the channel's close requeues what it holds
    except AmqpError as e:
        raise _mapped(e, what) from None
    return out


def publish_message(
    address: tuple[str, int], user: str, password: str, vhost: str, exchange: str, req: PublishRequest, timeout: float
) -> bool:
    """Publish ``req`` to ``exchange`` (``amq.default``: the default one): routed or not."""
    name = "" if exchange == "amq.default" else exchange
    what = f"publish to exchange '{exchange}' in vhost '{vhost}'"
    try:
        with _conversation(address, user, password, vhost, timeout) as c:
            return c.publish(name, req.routing_key, req.payload, req.properties)
    except AmqpError as e:
        raise _mapped(e, what) from None


# ---- exchanges and bindings ----------------------------------------------------------------


@dataclass(frozen=True)
class ExchangeSpec:
    type: str
    durable: bool
    auto_delete: bool
    internal: bool
    arguments: dict


@dataclass(frozen=True)
class BindingSpec:
    routing_key: str
    arguments: dict


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if isinstance(v, str) and v in ("true", "false"):
        return v == "true"
    if not isinstance(v, bool):
        raise Invalid(f"{key}: must be true or false, got {v!r}")
    return v


def _arguments(body: Mapping[str, Any]) -> dict:
    args = body.get("arguments") or {}
    if not isinstance(args, dict):
        raise Invalid(f"arguments: must be a JSON object, got {args!r}")
    return {str(k): _header_value(str(k), v) for k, v in args.items()}


def parse_exchange(body: Mapping[str, Any]) -> ExchangeSpec:
    kind = _required(body, "type", " | ".join(EXCHANGE_TYPES))
    if kind not in EXCHANGE_TYPES:
        raise Invalid(f"type: must be one of {', '.join(EXCHANGE_TYPES)}, got {kind!r}")
    return ExchangeSpec(
        kind,
        _flag(body, "durable", True),
        _flag(body, "auto_delete", False),
        _flag(body, "internal", False),
        _arguments(body),
    )


def parse_binding(body: Mapping[str, Any]) -> BindingSpec:
    rk = body.get("routing_key", "")
    if not isinstance(rk, str) or len(rk.encode()) > _SHORTSTR:
        raise Invalid(f"routing_key: must be a string of at most {_SHORTSTR} bytes, got {rk!r}")
    return BindingSpec(rk, _arguments(body))


def _call(
    address: tuple[str, int], user: str, password: str, vhost: str, what: str, timeout: float, method: Any, answer: type
) -> None:
    try:
        with _conversation(address, user, password, vhost, timeout) as c:
            c.call(method, answer)
    except AmqpError as e:
        raise _mapped(e, what) from None


def declare_exchange(address, user, password, vhost: str, name: str, spec: ExchangeSpec, timeout: float) -> None:
    method = C.Exchange.Declare(
        exchange=name,
        exchange_type=spec.type,
        durable=spec.durable,
        auto_delete=spec.auto_delete,
        internal=spec.internal,
        arguments=spec.arguments,
    )
    _call(address, user, password, vhost, f"declare of exchange '{name}'", timeout, method, C.Exchange.DeclareOk)


def delete_exchange(address, user, password, vhost: str, name: str, if_unused: bool, timeout: float) -> None:
    method = C.Exchange.Delete(exchange=name, if_unused=if_unused)
    _call(address, user, password, vhost, f"delete of exchange '{name}'", timeout, method, C.Exchange.DeleteOk)


def bind(
    address,
    user,
    password,
    vhost: str,
    source: str,
    kind: str,
    destination: str,
    spec: BindingSpec,
    timeout: float,
    unbind: bool = False,
) -> None:
    """Bind (``unbind``: unbind) ``destination`` (``kind`` "queue" or "exchange") to exchange ``source``."""
    what = f"{'unbind' if unbind else 'bind'} of {kind} '{destination}' {'from' if unbind else 'to'} '{source}'"
    method: Any
    ok: type
    if kind == "queue":
        if unbind:
            method, ok = (
                C.Queue.Unbind(
                    queue=destination, exchange=source, routing_key=spec.routing_key, arguments=spec.arguments
                ),
                C.Queue.UnbindOk,
            )
        else:
            method, ok = (
                C.Queue.Bind(
                    queue=destination, exchange=source, routing_key=spec.routing_key, arguments=spec.arguments
                ),
                C.Queue.BindOk,
            )
    else:
        cls, ok = (C.Exchange.Unbind, C.Exchange.UnbindOk) if unbind else (C.Exchange.Bind, C.Exchange.BindOk)
        method = cls(destination=destination, source=source, routing_key=spec.routing_key, arguments=spec.arguments)
    _call(address, user, password, vhost, what, timeout, method, ok)
