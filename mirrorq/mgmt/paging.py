"""Sorting, filtering and paging of a listing on the server, as RabbitMQ's management API does it.

``GET /api/queues?page=2&page_size=50&name=orders&use_regex=false&sort=messages&sort_reverse=true``
(pure: :func:`parse` reads the query into a :class:`ListQuery`, :func:`select`
applies it to a list of API objects, :func:`page_json` is the answer):

==============  ===========================================================================
``page``        1-based page number; present: the answer is a page object, absent: a list
``page_size``   objects per page, 1..:data:`MAX_PAGE_SIZE` (default :data:`DEFAULT_PAGE_SIZE`)
``name``        keep the objects whose ``name`` contains it (case-insensitive)
``use_regex``   ``true``: ``name`` is a regular expression searched in the name (case-insensitive)
``sort``        a field to sort by, dotted into nested objects
                (``message_stats.publish_details.rate``); absent: the listing's own order
``sort_reverse`` ``true``: descending
==============  ===========================================================================

A page object is ``{"items", "page", "page_count", "page_size",
"total_count", "filtered_count", "item_count"}`` (``total_count``: objects
before the filter; ``filtered_count``: after it; ``item_count``: on this
page; ``page_count``: pages of the filtered list, 0 when it is empty).
Without ``page`` the sort and the filter still apply and the answer is the
plain list (RabbitMQ's unpaged listing).

A bad parameter raises :class:`BadParameter` naming it (the API answers 400):
a ``page`` or ``page_size`` that is not a whole number in range, a page
past the last one, a ``name`` that is not a regular expression with
``use_regex``, a ``use_regex`` / ``sort_reverse`` that is not a boolean,
an empty ``sort``.

Sorting compares the field's values with missing (or null) values first,
then numbers, then strings, then anything else by its JSON text -- so a
queue whose master did not answer (its depth null) sorts before every
figure instead of failing the listing.  Only the page is copied out: the
filter and the sort look at every object, the answer holds
``page_size`` of them at most.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 500
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


class BadParameter(ValueError):
    """A query parameter the listing cannot take; ``param`` names it."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param


@dataclass(frozen=True)
class ListQuery:
    page: int | None = None
    page_size: int = DEFAULT_PAGE_SIZE
    name: str = ""
    use_regex: bool = False
    sort: tuple[str, ...] = ()
    sort_reverse: bool = False

    @property
    def paged(self) -> bool:
        return self.page is not None


@dataclass(frozen=True)
class Page:
    items: list[dict]
    page: int
    page_count: int
    page_size: int
    total_count: int
    filtered_count: int


def _bool(query: Mapping[str, str], param: str) -> bool:
    raw = query.get(param, "false").lower()
    if raw in TRUE:
        return True
    if raw in FALSE:
        return False
    raise BadParameter(param, f"must be true or false, got {raw!r}")


def _whole(query: Mapping[str, str], param: str, default: int, low: int, high: int | None) -> int:
    raw = query.get(param)
    if raw is None:
        return default
    try:
        n = int(raw)
    except ValueError:
        raise BadParameter(param, f"must be a whole number, got {raw!r}") from None
    if n < low or (high is not None and n > high):
        span = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise BadParameter(param, f"must be {span}, got {n}")
    return n


def parse(query: Mapping[str, str]) -> ListQuery:
    """The listing parameters of a request's query string (others are ignored)."""
    page = _whole(query, "page", 0, 1, None) if "page" in query else None
    page_size = _whole(query, "page_size", DEFAULT_PAGE_SIZE, 1, MAX_PAGE_SIZE)
    name = query.get("name", "")
    use_regex = _bool(query, "use_regex")
    if use_regex and name:
        try:
            re.compile(name)
        except re.error as e:
            raise BadParameter("name", f"is not a regular expression ({e}): {name!r}") from None
    sort: tuple[str, ...] = ()
    if "sort" in query:
        raw = query["sort"]
        if not raw or any(not part for part in raw.split(".")):
            raise BadParameter("sort", f"must name a field (dotted into nested objects), got {raw!r}")
        sort = tuple(raw.split("."))
    return ListQuery(page, page_size, name, use_regex, sort, _bool(query, "sort_reverse"))


def _field(obj: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def _sort_key(value: Any) -> tuple[int, Any]:
    if value is None:
        return (0, 0)
    if isinstance(value, bool):
        return (1, int(value))
    if isinstance(value, int | float):
        return (1, value)
    if isinstance(value, str):
        return (2, value)
    return (3, json.dumps(value, sort_keys=True, default=str))


def matching(items: Sequence[dict], q: ListQuery) -> list[dict]:
    """``items`` through the name filter, sorted as ``q`` says."""
    out: list[dict]
    if not q.name:
        out = list(items)
    elif q.use_regex:
        rx = re.compile(q.name, re.IGNORECASE)
        out = [o for o in items if rx.search(str(o.get("name", "")))]
    else:
        needle = q.name.casefold()
        out = [o for o in items if needle in str(o.get("name", "")).casefold()]
    if q.sort:
        out.sort(key=lambda o: _sort_key(_field(o, q.sort)), reverse=q.sort_reverse)
    return out


def select(items: Sequence[dict], q: ListQuery) -> Page:
    """The page ``q.page`` (1 when unpaged) of ``items`` filtered and sorted."""
    kept = matching(items, q)
    page = q.page or 1
    page_count = math.ceil(len(kept) / q.page_size)
    if page > max(page_count, 1):
        raise BadParameter("page", f"is past the last page ({page_count} pages of {q.page_size}), got {page}")
    start = (page - 1) * q.page_size
    return Page(kept[start : start + q.page_size], page, page_count, q.page_size, len(items), len(kept))


def page_json(p: Page) -> dict:
    return {
        "items": p.items,
        "page": p.page,
        "page_count": p.page_count,
        "page_size": p.page_size,
        "total_count": p.total_count,
        "filtered_count": p.filtered_count,
        "item_count": len(p.items),
    }
