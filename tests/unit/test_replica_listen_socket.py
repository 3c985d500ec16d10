"""The simulated replica's listening socket: accepted connections must not run Nagle.

asyncio sets TCP_NODELAY on an accepted connection only when the socket says it is TCP
(`proto == IPPROTO_TCP`); a socket made with proto 0 kept Nagle on, and with the client's delayed
ACKs every SSE chunk after the first on a keep-alive connection waited ~40 ms.
"""

from __future__ import annotations

import asyncio
import socket

from controlplane.sim_replica.server import listen_socket


async def test_accepted_connections_have_tcp_nodelay() -> None:
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted = writer.get_extra_info("socket")
        seen.set_result(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(handler, sock=sock)
    try:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(seen, 5.0) != 0
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
