"""Binding the two listening ports, and the one-line error when one cannot be had.

A port already in use (a second ``tally serve``, another program) is the usual first-day failure:
``tally serve`` reports it as one line naming the address and the flag and environment variable
that choose another, never as gRPC's ``RuntimeError`` and its traceback.
"""

from __future__ import annotations

import errno
import socket
from typing import Literal

import grpc

from tally_server.settings import split_listen

Wire = Literal["gRPC", "HTTP"]

_OPTION = {"gRPC": ("--grpc-listen", "TALLY_GRPC_LISTEN"), "HTTP": ("--http-listen", "TALLY_HTTP_LISTEN")}


class CannotListen(OSError):
    """A listening address could not be bound.

    An ``OSError``, so ``tally serve`` prints it as one line and exits non-zero.
    """

    def __init__(self, wire: Wire, listen: str, err: OSError | None) -> None:
        flag, env = _OPTION[wire]
        if err is None:
            reason = "gRPC could not bind it"
        else:
            reason = (err.strerror or str(err)).lower()
            if err.errno == errno.EADDRINUSE:
                reason += " (by another tally serve, or another program)"
        super().__init__(
            f"cannot listen for {wire} on {listen}: {reason}; choose another address with {flag} HOST:PORT "
            f"or {env} (port 0 picks a free one)"
        )


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_http(listen: str) -> socket.socket:
    """A non-blocking listening socket for uvicorn.

    Made with protocol ``IPPROTO_TCP`` (not 0) because asyncio sets ``TCP_NODELAY`` only on the
    connections of such a socket: without it, a response written in two parts (uvicorn writes
    the headers, then the body) waits for the client's delayed ACK, 40 ms on Linux, on every
    request of a kept-alive connection.

    Raises:
        CannotListen: The address is in use or not available here.
    """
    host, port = split_listen(listen)
    sock = socket.socket(_family(host), socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise CannotListen("HTTP", listen, err) from None
    sock.setblocking(False)
    return sock


def add_grpc_port(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None) -> int:
    """Add ``listen`` to a gRPC server; the port bound.

    An address in use is found by trying it first (gRPC would log its own error line and raise a
    ``RuntimeError`` that does not say why).

    Raises:
        CannotListen: The address is in use, or gRPC could not bind it.
    """
    in_use = _in_use(listen)
    if in_use is not None:
        raise CannotListen("gRPC", listen, in_use)
    try:
        port = (
            server.add_secure_port(listen, credentials)
            if credentials is not None
            else server.add_insecure_port(listen)
        )
    except RuntimeError:
        port = 0
    if port == 0:
        raise CannotListen("gRPC", listen, None)
    return port


def _in_use(listen: str) -> OSError | None:
    """The error of binding ``listen`` if that is "address in use"; None otherwise.

    Other failures are left to gRPC, which may resolve the host differently.
    """
    host, port = split_listen(listen)
    if port == 0:
        return None
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as err:
        return err if err.errno == errno.EADDRINUSE else None
    return None
