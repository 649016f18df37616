"""The management server's routes: RabbitMQ's HTTP API for what mirrorq has.

=========================================  ====================================================
GET /api/overview                          versions, object totals, queue totals, message rates
GET /api/nodes[/{node}]                    every node: running (as this node sees it), memory,
                                           registry (Raft) role, term and commit index
GET /api/queues[/{vhost}[/{name}]]         queues with node, slave_nodes, synchronised ones,
                                           messages, message_stats (+ rates), ``ring``; the
                                           listings take RabbitMQ's ``page``, ``page_size``,
                                           ``name``, ``use_regex``, ``sort``, ``sort_reverse``
                                           (:mod:`.paging`: with ``page`` a page object)
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
GET /api/exchanges[/{vhost}]               exchanges (the built-in ones too)
GET /api/bindings[/{vhost}]                bindings (the default exchange's too)
GET /api/connections, /api/channels        every node's client connections and channels
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

    async def queue_listing(request: web.Request) -> web.Response:
        q = paging.parse(request.query)  # a bad parameter is a 400 before any cluster work
        vhost = request.match_info.get("vhost")
        queues = await call(source.queues, *([vhost] if vhost is not None else []))
        if not q.paged:
            return _json(paging.matching(queues, q))
        return _json(paging.page_json(paging.select(queues, q)))

    r.add_get("/api/queues", queue_listing)
    r.add_get("/api/queues/{vhost}", queue_listing)
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

    def credentials(q: web.Request) -> tuple[str, str]:
        creds = auth.parse_basic(q.headers.get("Authorization"))
        assert creds is not None  # the auth middleware let the request in
        return creds

    async def get_messages(q: web.Request) -> web.Response:
        body = await _body(q)
        got = await call(source.get_messages, m(q, "vhost"), m(q, "name"), body, *credentials(q))
        return _json(got)

    async def publish(q: web.Request) -> web.Response:
        body = await _body(q)
        return _json(await call(source.publish, m(q, "vhost"), m(q, "name"), body, *credentials(q)))

    r.add_post("/api/queues/{vhost}/{name}/get", get_messages)
    r.add_post("/api/exchanges/{vhost}/{name}/publish", publish)
    get("/api/exchanges", "exchanges")
    get("/api/exchanges/{vhost}", "exchanges", "vhost")
    get("/api/bindings", "bindings")
    get("/api/bindings/{vhost}", "bindings", "vhost")
    get("/api/connections", "connections")
    get("/api/channels", "channels")
    get("/api/consumers", "consumers")
    get("/api/consumers/{vhost}", "consumers", "vhost")
    get("/api/policies", "policies")
    get("/api/policies/{vhost}", "policies", "vhost")
    get("/api/policies/{vhost}/{name}", "policy", "vhost", "name")
    put("/api/policies/{vhost}/{name}", "put_policy", "vhost", "name")
    delete("/api/policies/{vhost}/{name}", "delete_policy", "vhost", "name")
    get("/api/users", "users")
    get("/api/users/{name}", "user", "name")
    put("/api/users/{name}", "put_user", "name")
    delete("/api/users/{name}", "delete_user", "name")
    get("/api/vhosts", "vhosts")
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
