"""The management server's routes: RabbitMQ's HTTP API for what mirrorq has.

=========================================  ====================================================
GET /api/overview                          versions, object totals, queue totals, message rates
GET /api/nodes[/{node}]                    every node: running (as this node sees it), memory,
                                           disk, alarms, partition, uptime, fd/sockets/processes
                                           (nodes on this host), registry (Raft) role, term and
                                           commit index, queue_masters / queue_mirrors held; one
                                           node: its master_queues and mirror_queues too
GET /api/queues[/{vhost}[/{name}]]         queues with node, slave_nodes, synchronised ones,
                                           messages, message_stats (+ rates), ``ring``
GET /api/queues/{vhost}/{name}/bindings    the queue's bindings
PUT /api/queues/{vhost}/{name}             declare (body: durable, auto_delete, arguments):
                                           201 created, 204 an equivalent one exists, 400 not
DELETE /api/queues/{vhost}/{name}          ?if-empty=true&if-unused=true as RabbitMQ
DELETE /api/queues/{vhost}/{name}/contents purge: the master removes the ready messages (204)
POST /api/queues/{vhost}/{name}/actions    body ``{"action": "sync" | "cancel_sync"}``: the
                                           master (un)syncs its mirrors (204; 400 another action)
POST /api/queues/{vhost}/{name}/get        body ``count``, ``ackmode``, ``encoding``, ``truncate``:
                                           the messages got (:mod:`mirrorq.admin.messages`)
POST /api/exchanges/{vhost}/{name}/publish body ``routing_key``, ``properties``, ``payload``,
                                           ``payload_encoding``: ``{"routed": bool}``
GET /api/exchanges[/{vhost}[/{name}]]      exchanges (the built-in ones too; ``amq.default``
                                           names the default one); PUT (type, durable,
                                           auto_delete, internal, arguments) 201 / 204, DELETE
                                           (?if-unused=true), as the asking user
GET /api/exchanges/{vhost}/{name}/bindings/source, .../destination
GET /api/bindings[/{vhost}]                bindings (the default exchange's too)
GET /api/bindings/{vhost}/e/{ex}/q/{queue} the bindings between the two (``/e/{ex2}``: to an
                                           exchange); POST (routing_key, arguments) 201 with
                                           ``Location`` .../{props}; GET, DELETE .../{props}
                                           (``properties_key``), as the asking user
GET /api/connections[/{name}]              every node's client connections; DELETE closes one
                                           (320 CONNECTION_FORCED, reason from ``X-Reason``)
GET /api/connections/{name}/channels       its channels
GET /api/channels[/{name}]                 every node's channels
GET /api/consumers[/{vhost}]               consumers
GET /api/policies[/{vhost}[/{name}]]       PUT (pattern, definition, priority, apply-to), DELETE
GET /api/users[/{name}]                    PUT (password or password_hash, tags), DELETE
GET /api/vhosts[/{name}]                   PUT, DELETE
GET /api/permissions[/{vhost}/{user}]      PUT (configure, write, read), DELETE
GET /api/health/checks/alarms              200 ``{"status": "ok"}`` when no resource alarm is in
                                           effect in the cluster, else 503 ``{"status":
                                           "failed", "reason", "alarms": [{node, resource}]}``
GET /api/health/checks/local-alarms        the same for this node's own alarms
GET /metrics                               Prometheus (:mod:`.metrics`; no auth)
GET /                                      the live ring page (:mod:`.page`)
=========================================  ====================================================

The listings of queues, exchanges, connections, channels, policies, users
and vhosts take RabbitMQ's ``page``, ``page_size``, ``name``,
``use_regex``, ``sort``, ``sort_reverse`` (:mod:`.paging`: with ``page``
the answer is a page object).  What changes messages or topology as a
user -- get, publish, exchanges, bindings -- runs as the asking user over
AMQP (:mod:`mirrorq.admin.messages`).

Path segments are URL-decoded (a vhost ``/`` is ``%2F``).  A PUT answers
201 when it created the object and 204 when it replaced or kept one; a
DELETE 204.  Errors are RabbitMQ's JSON ``{"error": ..., "reason": ...}``:
400 ``bad_request`` (a body that is not a JSON object, or names what is
wrong), 401/403 (:mod:`.auth`; a get or publish the broker refuses the
user: 401 ``not_authorised`` with the broker's text, as RabbitMQ), 404 ``Object Not Found``, 405 for a method a
path does not take, 503 when the node (or a queue master) does not answer
in time, 500 for any other failure (logged with its traceback).

Every handler runs the blocking :class:`~.source.NodeSource` call through
``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import json
import time
import traceback
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from aiohttp import web

from mirrorq.admin.cluster import AccessRefused, ClusterError, CommandTimeout, Invalid, NodeUnavailable, NotFound
from mirrorq.admin.ops import QUEUE_ACTIONS
from mirrorq.mgmt import auth, metrics, page, paging


def error_response(status: int, error: str, reason: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": error, "reason": reason}, status=status, headers=headers)


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str)


def _json(value: Any, status: int = 200) -> web.Response:
    return web.json_response(value, status=status, dumps=lambda v: _dumps(v))


async def _body(request: web.Request) -> dict:
    """The request's JSON object (an empty body is ``{}``); 400 otherwise."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _Bad(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise _Bad(f"the body must be a JSON object, got {type(body).__name__}")
    return body


class _Bad(Exception):
    pass


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "false").lower() in ("true", "1", "yes")


def build_app(source, log: Callable[..., None] | None = None) -> web.Application:
    """The aiohttp application over ``source`` (a NodeSource, or a fake with
    its methods); ``log(event, **fields)`` gets one access line per request
    and every internal error."""
    log = log or (lambda *a, **k: None)

    @web.middleware
    async def errors(request: web.Request, handler):
        t0 = time.monotonic()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            if e.status == 404:
                return error_response(404, "Object Not Found", "Not Found")
            if e.status == 405:
                return error_response(405, "Method Not Allowed", f"{request.method} is not allowed on {request.path}")
            raise
        except _Bad as e:
            status = 400
            return error_response(400, "bad_request", str(e))
        except paging.BadParameter as e:
            status = 400
            return error_response(400, "bad_request", str(e))
        except NotFound as e:
            status = 404
            return error_response(404, "Object Not Found", str(e))
        except Invalid as e:
            status = 400
            return error_response(400, "bad_request", str(e))
        except AccessRefused as e:
            status = 401
            return error_response(401, "not_authorised", str(e))
        except (NodeUnavailable, CommandTimeout) as e:
            status = 503
            return error_response(503, "unavailable", str(e))
        except ClusterError as e:
            status = 500
            return error_response(500, "internal_server_error", str(e))
        except Exception as e:  # noqa: BLE001 - every failure is a JSON 500 and a log line
            status = 500
            log(
                "mgmt_handler_error",
                level="error",
                method=request.method,
                path=request.path,
                error=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc(limit=8),
            )
            return error_response(500, "internal_server_error", f"{type(e).__name__}: {e}")
        finally:
            log(
                "http_request",
                method=request.method,
                path=request.path,
                status=status,
                user=request.get(auth.USER),
                peer=request.remote,
                ms=round((time.monotonic() - t0) * 1000, 1),
            )

    app = web.Application(middlewares=[errors, auth.middleware(source, error_response)])

    def call(fn, *args):
        return asyncio.to_thread(fn, *args)

    def m(request: web.Request, key: str) -> str:
        return request.match_info[key]  # aiohttp decodes %2F in a segment to "/"

    def credentials(q: web.Request) -> tuple[str, str]:
        """The asking user's (name, password): what runs as that user over AMQP logs in with them."""
        creds = auth.parse_basic(q.headers.get("Authorization"))
        assert creds is not None  # the auth middleware let the request in
        return creds

    r = app.router

    # fn: the name of the source's method, looked up per request
    def get(path: str, fn: str, *keys: str) -> None:
        async def handler(request: web.Request) -> web.Response:
            return _json(await call(getattr(source, fn), *(m(request, k) for k in keys)))

        r.add_get(path, handler)

    def put(path: str, fn: str, *keys: str, body: bool = True) -> None:
        async def handler(request: web.Request) -> web.Response:
            args: list[str | dict[str, Any]] = [m(request, k) for k in keys]
            if body:
                args.append(await _body(request))
            created = await call(getattr(source, fn), *args)
            return web.Response(status=201 if created else 204)

        r.add_put(path, handler)

    def delete(path: str, fn: str, *keys: str) -> None:
        async def handler(request: web.Request) -> web.Response:
            await call(getattr(source, fn), *(m(request, k) for k in keys))
            return web.Response(status=204)

        r.add_delete(path, handler)

    get("/api/overview", "overview")
    get("/api/nodes", "nodes")
    get("/api/nodes/{node}", "node_info", "node")

    def listing(fn: str, *keys: str):
        """A listing the paging parameters apply to (:mod:`.paging`)."""

        async def handler(request: web.Request) -> web.Response:
            q = paging.parse(request.query)  # a bad parameter is a 400 before any cluster work
            items = await call(getattr(source, fn), *(m(request, k) for k in keys))
            if not q.paged:
                return _json(paging.matching(items, q))
            return _json(paging.page_json(paging.select(items, q)))

        return handler

    r.add_get("/api/queues", listing("queues"))
    r.add_get("/api/queues/{vhost}", listing("queues", "vhost"))
    get("/api/queues/{vhost}/{name}", "queue", "vhost", "name")
    put("/api/queues/{vhost}/{name}", "put_queue", "vhost", "name")

    async def delete_queue(q: web.Request) -> web.Response:
        await call(source.delete_queue, m(q, "vhost"), m(q, "name"), _flag(q, "if-empty"), _flag(q, "if-unused"))
        return web.Response(status=204)

    r.add_delete("/api/queues/{vhost}/{name}", delete_queue)

    async def purge_queue(q: web.Request) -> web.Response:
        await call(source.purge_queue, m(q, "vhost"), m(q, "name"))
        return web.Response(status=204)

    async def queue_action(q: web.Request) -> web.Response:
        action = (await _body(q)).get("action")
        if action not in QUEUE_ACTIONS:
            raise _Bad(f"action: must be one of {', '.join(QUEUE_ACTIONS)}, got {action!r}")
        await call(source.queue_action, m(q, "vhost"), m(q, "name"), action)
        return web.Response(status=204)

    r.add_delete("/api/queues/{vhost}/{name}/contents", purge_queue)
    r.add_post("/api/queues/{vhost}/{name}/actions", queue_action)

    async def get_messages(q: web.Request) -> web.Response:
        body = await _body(q)
        got = await call(source.get_messages, m(q, "vhost"), m(q, "name"), body, *credentials(q))
        return _json(got)

    async def publish(q: web.Request) -> web.Response:
        body = await _body(q)
        return _json(await call(source.publish, m(q, "vhost"), m(q, "name"), body, *credentials(q)))

    r.add_post("/api/queues/{vhost}/{name}/get", get_messages)
    r.add_post("/api/exchanges/{vhost}/{name}/publish", publish)
    r.add_get("/api/exchanges", listing("exchanges"))
    r.add_get("/api/exchanges/{vhost}", listing("exchanges", "vhost"))
    get("/api/exchanges/{vhost}/{name}", "exchange", "vhost", "name")

    async def put_exchange(q: web.Request) -> web.Response:
        body = await _body(q)
        created = await call(source.put_exchange, m(q, "vhost"), m(q, "name"), body, *credentials(q))
        return web.Response(status=201 if created else 204)

    async def delete_exchange(q: web.Request) -> web.Response:
        await call(source.delete_exchange, m(q, "vhost"), m(q, "name"), _flag(q, "if-unused"), *credentials(q))
        return web.Response(status=204)

    r.add_put("/api/exchanges/{vhost}/{name}", put_exchange)
    r.add_delete("/api/exchanges/{vhost}/{name}", delete_exchange)

    def bindings_of(role: str):
        async def handler(q: web.Request) -> web.Response:
            vhost, name = m(q, "vhost"), m(q, "name")
            if role == "source":
                return _json(await call(source.bindings_of, vhost, name))
            kind = "queue" if role == "queue" else "exchange"
            return _json(await call(source.bindings_of, vhost, None, kind, name))

        return handler

    r.add_get("/api/exchanges/{vhost}/{name}/bindings/source", bindings_of("source"))
    r.add_get("/api/exchanges/{vhost}/{name}/bindings/destination", bindings_of("destination"))
    r.add_get("/api/queues/{vhost}/{name}/bindings", bindings_of("queue"))
    get("/api/bindings", "bindings")
    get("/api/bindings/{vhost}", "bindings", "vhost")
    kinds = {"q": "queue", "e": "exchange"}

    def between(q: web.Request) -> tuple[str, str, str, str]:
        return m(q, "vhost"), m(q, "source"), kinds[m(q, "kind")], m(q, "destination")

    async def list_between(q: web.Request) -> web.Response:
        return _json(await call(source.bindings_of, *between(q)))

    async def add_binding(q: web.Request) -> web.Response:
        body = await _body(q)
        props = await call(source.add_binding, *between(q), body, *credentials(q))
        vhost, src, _, dst = (quote(x, safe="") for x in between(q))
        where = f"/api/bindings/{vhost}/e/{src}/{m(q, 'kind')}/{dst}/{quote(props, safe='')}"
        return web.Response(status=201, headers={"Location": where})

    async def one_binding(q: web.Request) -> web.Response:
        found = [b for b in await call(source.bindings_of, *between(q)) if b["properties_key"] == m(q, "props")]
        if not found:
            raise NotFound(f"no binding '{m(q, 'props')}' from '{m(q, 'source')}' to '{m(q, 'destination')}'")
        return _json(found[0])

    async def delete_binding(q: web.Request) -> web.Response:
        await call(source.delete_binding, *between(q), m(q, "props"), *credentials(q))
        return web.Response(status=204)

    pair = "/api/bindings/{vhost}/e/{source}/{kind:[eq]}/{destination}"
    r.add_get(pair, list_between)
    r.add_post(pair, add_binding)
    r.add_get(pair + "/{props}", one_binding)
    r.add_delete(pair + "/{props}", delete_binding)
    r.add_get("/api/connections", listing("connections"))
    get("/api/connections/{name}", "connection", "name")
    get("/api/connections/{name}/channels", "connection_channels", "name")

    async def close_connection(q: web.Request) -> web.Response:
        reason = q.headers.get("X-Reason", "Closed via management plugin")
        await call(source.close_connection, m(q, "name"), reason)
        return web.Response(status=204)

    r.add_delete("/api/connections/{name}", close_connection)
    r.add_get("/api/channels", listing("channels"))
    get("/api/channels/{name}", "channel", "name")
    get("/api/consumers", "consumers")
    get("/api/consumers/{vhost}", "consumers", "vhost")
    r.add_get("/api/policies", listing("policies"))
    r.add_get("/api/policies/{vhost}", listing("policies", "vhost"))
    get("/api/policies/{vhost}/{name}", "policy", "vhost", "name")
    put("/api/policies/{vhost}/{name}", "put_policy", "vhost", "name")
    delete("/api/policies/{vhost}/{name}", "delete_policy", "vhost", "name")
    r.add_get("/api/users", listing("users"))
    get("/api/users/{name}", "user", "name")
    put("/api/users/{name}", "put_user", "name")
    delete("/api/users/{name}", "delete_user", "name")
    r.add_get("/api/vhosts", listing("vhosts"))
    get("/api/vhosts/{name}", "vhost", "name")
    put("/api/vhosts/{name}", "put_vhost", "name", body=False)
    delete("/api/vhosts/{name}", "delete_vhost", "name")
    get("/api/permissions", "permissions")
    get("/api/permissions/{vhost}/{user}", "permission", "vhost", "user")
    put("/api/permissions/{vhost}/{user}", "put_permission", "vhost", "user")
    delete("/api/permissions/{vhost}/{user}", "delete_permission", "vhost", "user")

    def alarms_check(local: bool):
        async def handler(request: web.Request) -> web.Response:
            alarms = await call(source.alarms, local)
            if not alarms:
                return _json({"status": "ok"})
            where = "on this node" if local else "in the cluster"
            return _json({"status": "failed", "reason": f"There are alarms in effect {where}", "alarms": alarms}, 503)

        return handler

    r.add_get("/api/health/checks/alarms", alarms_check(False))
    r.add_get("/api/health/checks/local-alarms", alarms_check(True))

    async def scrape(q: web.Request) -> web.Response:
        snap = await call(source.metrics_snapshot)
        return web.Response(body=metrics.render(snap), headers={"Content-Type": metrics.CONTENT_TYPE})

    r.add_get("/metrics", scrape)
    page.add_routes(app, source)
    return app
