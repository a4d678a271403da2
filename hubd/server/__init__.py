"""The sidecar websocket server: handshake decisions, the socket router, the listener."""

from hubd.server.handshake import CONNECT_PATH, SUBPROTOCOL, CloseCode, HandshakeRequest, Rejection
from hubd.server.listener import SidecarServer
from hubd.server.router import SocketRouter
from hubd.server.sockets import SocketEntry
from hubd.server.wire import ServerStats

__all__ = [
    "CONNECT_PATH",
    "SUBPROTOCOL",
    "CloseCode",
    "HandshakeRequest",
    "Rejection",
    "ServerStats",
    "SidecarServer",
    "SocketEntry",
    "SocketRouter",
]
