"""Socket details shared by the bridge and the device-side tools."""

from __future__ import annotations

import contextlib
import socket
from typing import Any


def set_nodelay(_client: Any, _userdata: Any, sock: Any) -> None:
    """paho's on_socket_open: without TCP_NODELAY every small publish waits
    for Nagle's delayed ACK (~40-90 ms a hop on loopback)."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
