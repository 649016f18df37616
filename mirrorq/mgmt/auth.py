"""HTTP basic auth for the management API and page, against the registry's users.

The password check is the AMQP login's (:meth:`mirrorq.amqp.topology.Topology.authenticate`:
salted SHA-256 hashes in the ``user`` table; the built-in guest/guest from
loopback only), read linearizably on every request, so a user removed,
re-tagged or given a new password is refused at once.  Only users tagged
``administrator`` are let in, as RabbitMQ's management plugin does for
everything it shows here:

* no or malformed ``Authorization`` header, or a failed login: 401 with
  ``WWW-Authenticate: Basic realm="mirrorq management"`` (a browser asks);
* a good login without the tag: 403.

``/metrics`` is open, as rabbitmq_prometheus' endpoint is (a scraper has no
user); everything else (``/`` and ``/api/...``) is behind this.
"""

from __future__ import annotations

import asyncio
import base64
import binascii

from aiohttp import web

REALM = 'Basic realm="mirrorq management"'
#: where a request keeps its authenticated user name
USER = web.RequestKey("user", str) if hasattr(web, "RequestKey") else "mirrorq.user"
OPEN_PATHS = ("/metrics",)


def parse_basic(header: str | None) -> tuple[str, str] | None:
    """(user, password) from an ``Authorization: Basic ...`` header, None if absent or malformed."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or not value.strip():
        return None
    try:
        text = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    user, sep, password = text.partition(":")
    return (user, password) if sep else None


def middleware(source, error_response):
    """An aiohttp middleware checking every request but OPEN_PATHS against ``source.authenticate``."""

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path in OPEN_PATHS:
            return await handler(request)
        creds = parse_basic(request.headers.get("Authorization"))
        if creds is None:
            return error_response(
                401,
                "not_authorised",
                "Login failed: no credentials (HTTP basic auth)",
                headers={"WWW-Authenticate": REALM},
            )
        code, why = await asyncio.to_thread(source.authenticate, creds[0], creds[1], request.remote or "")
        if code == 401:
            return error_response(401, "not_authorised", f"Login failed: {why}", headers={"WWW-Authenticate": REALM})
        if code == 403:
            return error_response(403, "not_authorised", f"Not administrator user: {why}")
        request[USER] = creds[0]
        return await handler(request)

    return check
