"""Liveness of the tcp request plane: keepalive, heartbeats on silent streams, the client's
idle timeout against a frozen peer, and the bound on concurrent streams."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from turnout.errors import PeerUnavailable, StreamBroken
from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.request_plane import TcpClient, TcpServer


async def slow(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    """Silent for ``payload`` seconds, then one item."""
    await asyncio.sleep(float(payload))
    yield b"done"


async def hang(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield b"first"
    await asyncio.get_running_loop().create_future()


async def serve(server: TcpServer) -> TransportAddress:
    server.register("slow", slow)
    server.register("hang", hang)
    return await server.start()


async def collect(
    client: TcpClient, address: TransportAddress, path: str, payload: bytes
) -> list[bytes]:
    stream = client.stream(address, path, payload, RequestContext("r"))
    try:
        return [item async for item in stream]
    finally:
        await stream.aclose()


async def test_heartbeats_keep_a_silent_stream_alive() -> None:
    server = TcpServer(heartbeat_interval=0.05)
    client = TcpClient(idle_timeout=0.3)
    try:
        address = await serve(server)
        # Silent for three idle timeouts: only the heartbeats say the peer is alive.
        assert await collect(client, address, "slow", b"0.9") == [b"done"]
    finally:
        await client.close()
        await server.stop()


async def test_a_silent_peer_breaks_the_stream() -> None:
    server = TcpServer(heartbeat_interval=0)  # a frozen process sends nothing either
    client = TcpClient(idle_timeout=0.2)
    try:
        address = await serve(server)
        with pytest.raises(StreamBroken, match=r"heard nothing for 0\.2s"):
            await collect(client, address, "hang", b"")
    finally:
        await client.close()
        await server.stop()


async def test_an_idle_connection_is_not_dropped() -> None:
    server = TcpServer(heartbeat_interval=0)
    client = TcpClient(idle_timeout=0.1)
    try:
        address = await serve(server)
        assert await collect(client, address, "slow", b"0") == [b"done"]
        conn = next(iter(client._conns.values()))
        await asyncio.sleep(0.4)  # no streams: silence is fine
        assert conn.is_open
        assert await collect(client, address, "slow", b"0") == [b"done"]
        assert next(iter(client._conns.values())) is conn
    finally:
        await client.close()
        await server.stop()


async def test_both_ends_turn_keepalive_on() -> None:
    server = TcpServer()
    client = TcpClient()
    try:
        address = await serve(server)
        assert await collect(client, address, "slow", b"0") == [b"done"]
        conns = [next(iter(client._conns.values())), next(iter(server._conns))]
        for conn in conns:
            assert conn.transport is not None
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_USER_TIMEOUT"):  # unacknowledged data is bounded too
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 25_000
    finally:
        await client.close()
        await server.stop()


async def test_streams_past_the_bound_are_refused() -> None:
    server = TcpServer(max_streams=1)
    client = TcpClient()
    try:
        address = await serve(server)
        first = client.stream(address, "hang", b"", RequestContext("a"))
        assert await first.__anext__() == b"first"
        with pytest.raises(PeerUnavailable, match="limit of 1 streams"):
            await collect(client, address, "slow", b"0")
        await first.aclose()
    finally:
        await client.close()
        await server.stop()
