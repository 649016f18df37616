"""GM member names and the ``gm_group`` transactions: plain data, no transport.

A member's name is ``"<node>/<host>:<port>/<uid>"``: the node that hosts it,
the ``host:port`` its messages go to, and a uid that makes it unique for ever
(see :mod:`mirrorq.gm.shell`).  A group's view is the ``gm_group`` row
``{name, version, members}``; :func:`create_txn` founds it and
:func:`propose_txn` replaces one version by the next, so of concurrent
proposals against one version exactly one commits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Self

from mirrorq.gm.core import ProposeView

GM_TABLE = "gm_group"


class MemberRef(tuple[str, str, int, str]):
    """``(node, host, port, uid)`` parsed from a member name."""

    __slots__ = ()

    def __new__(cls, node: str, host: str, port: int, uid: str) -> Self:
        return super().__new__(cls, (node, host, port, uid))

    @property
    def node(self) -> str:
        return self[0]

    @property
    def host(self) -> str:
        return self[1]

    @property
    def port(self) -> int:
        return self[2]

    @property
    def uid(self) -> str:
        return self[3]


def member_name(node: str, host: str, port: int, uid: str) -> str:
    for what, v in (("node", node), ("host", host), ("uid", uid)):
        if not isinstance(v, str) or not v or "/" in v:
            raise ValueError(f"GM member name: {what} must be a non-empty string without '/', got {v!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"GM member name: port must be 1-65535, got {port!r}")
    return f"{node}/{host}:{port}/{uid}"


def parse_member_name(name: str) -> MemberRef:
    """Inverse of :func:`member_name`; ValueError naming the text if malformed."""
    if not isinstance(name, str):
        raise ValueError(f"a GM member name is a string, got {type(name).__name__}")
    parts = name.split("/")
    if len(parts) == 3:
        node, hostport, uid = parts
        host, sep, port = hostport.rpartition(":")
        if node and uid and sep and host and port.isdigit() and 0 < int(port) < 65536:
            return MemberRef(node, host, int(port), uid)
    raise ValueError(f"{name!r} is not a GM member name (node/host:port/uid)")


# ---- registry transactions -------------------------------------------------------
def create_txn(group: str, founders: Iterable[str]) -> dict[str, Any]:
    """Found ``group`` at version 1 with ``founders`` (only if absent)."""
    return {
        "checks": [{"table": GM_TABLE, "key": group, "absent": True}],
        "ops": [
            {
                "op": "put",
                "table": GM_TABLE,
                "key": group,
                "record": {"name": group, "version": 1, "members": list(founders)},
            }
        ],
    }


def propose_txn(group: str, ev: ProposeView) -> dict[str, Any]:
    """Replace view ``ev.expected_version`` by ``ev.members`` (only if the
    row's version still is the expected one)."""
    return {
        "checks": [{"table": GM_TABLE, "key": group, "field": "version", "equals": ev.expected_version}],
        "ops": [
            {
                "op": "update",
                "table": GM_TABLE,
                "key": group,
                "fields": {"version": ev.expected_version + 1, "members": list(ev.members)},
            }
        ],
    }
