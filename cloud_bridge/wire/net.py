"""Socket details shared by every MQTT client (see cloud_bridge/wire/mqtt.py)."""

from __future__ import annotations

import contextlib
import socket
from typing import Any


def set_nodelay(_client: Any, _userdata: Any, sock: Any) -> None:
    """paho's on_socket_open: without TCP_NODELAY every small publish waits
    for Nagle's delayed ACK (~40-90 ms a hop on loopback)."""
    raw = getattr(sock, "_sock", sock)  # paho's websocket wrapper keeps the socket inside
    with contextlib.suppress(OSError, AttributeError):
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
