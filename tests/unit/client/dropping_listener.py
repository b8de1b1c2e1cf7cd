"""A port that takes connections and drops them unanswered, as a coordinator killed mid-call does."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def dropping_listener() -> Iterator[tuple[int, Callable[[], None]]]:
    """Listen on a free loopback port; close each connection after reading its first bytes.

    Yields the port and a function that stops listening: once it returned, connections to the port
    are refused (the coordinator is down).
    """
    server = socket.create_server(("127.0.0.1", 0))
    closed = threading.Event()

    def serve() -> None:
        while not closed.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(65536)
                except OSError:
                    pass

    def close() -> None:
        if closed.is_set():
            return
        closed.set()
        try:
            server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        server.close()

    thread = threading.Thread(target=serve, name="dropping-listener", daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], close
    finally:
        close()
        thread.join(5)
