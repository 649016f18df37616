"""Thespian TCP actor addresses as text, and back.

Every actor of a ``multiprocTCPBase`` system listens on its own ``host:port``;
that text is how mirrorq names a place to send to inside records and
messages that must stay plain data (registry rows, GM member names, channel
ids).  Thespian's ``ActorAddress`` is not hashable, so dicts keyed by actors
use :func:`address_key`.
"""

from __future__ import annotations

from typing import Any

from thespian.actors import ActorAddress
from thespian.system.transport.IPBase import TCPv4ActorAddress

from mirrorq.node.config import parse_address


def address_host_port(address: Any) -> tuple[str, int] | None:
    """``(host, port)`` of a Thespian TCP actor address, None for others."""
    details = getattr(address, "addressDetails", None)
    sock = getattr(details, "sockname", None)
    if isinstance(sock, tuple) and len(sock) >= 2:
        return str(sock[0]), int(sock[1])
    return None


def address_text(address: Any) -> str:
    """``"host:port"`` of a TCP actor address; ValueError for others."""
    hp = address_host_port(address)
    if hp is None:
        raise ValueError(f"not a TCP actor address: {address!r}")
    return f"{hp[0]}:{hp[1]}"


def address_from_text(text: str) -> ActorAddress:
    """The Thespian address listening on ``"host:port"``."""
    host, port = parse_address(text)
    return ActorAddress(TCPv4ActorAddress(host, port))


def address_key(address: Any) -> str:
    """A hashable key for any Thespian address."""
    hp = address_host_port(address)
    return f"{hp[0]}:{hp[1]}" if hp else str(address)


def member_host(dst: str) -> str | None:
    """``"host:port"`` of the actor hosting a queue replica named ``dst``
    (a GM member name ``node/host:port/uid``); None when ``dst`` is not one
    (a plain ``"host:port"``)."""
    if "/" not in dst:
        return None
    parts = dst.split("/")
    if len(parts) != 3 or not parts[1]:
        raise ValueError(f"{dst!r} is neither host:port nor a queue replica's name (node/host:port/uid)")
    return parts[1]
