"""The HTTP listening socket: its connections send small writes at once (TCP_NODELAY)."""

from __future__ import annotations

import asyncio
import socket

from tally_server.listen import bind_http


def test_connections_of_the_http_socket_have_nodelay() -> None:
    # Without TCP_NODELAY, uvicorn's two writes of a response (headers, then body) waited for the
    # client's delayed ACK: 40 ms for each request of a kept-alive connection.
    async def main() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listening = bind_http("127.0.0.1:0")
        server = await asyncio.get_running_loop().create_server(Probe, sock=listening)
        async with server:
            port = listening.getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
        return nodelay

    assert asyncio.run(main()) != 0
