"""The request's trace context on the request planes: a ``traceparent`` reaches the handler on
every plane (tcp and nats in the REQUEST frame's trailing field, local by copy), and the
field's place in the frame keeps peers that predate it, or follow it, talking."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from tests.runtime.test_request_plane import Plane
from tests.runtime.test_request_plane import nats_server as nats_server  # the fixtures
from tests.runtime.test_request_plane import plane as plane

from turnout.runtime.context import RequestContext
from turnout.runtime.request_plane.framing import Frame, FrameReader, FrameWriter, Kind

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class FrameBeforeTrace(msgspec.Struct, array_like=True, omit_defaults=True):
    """A REQUEST frame as a peer without the trace field writes and reads it."""

    kind: int
    stream_id: int
    data: bytes | list[bytes] = b""
    text: str = ""
    num: int = 0
    text2: str = ""


class FrameAfterTrace(msgspec.Struct, array_like=True, omit_defaults=True):
    """A REQUEST frame as a peer with one more trailing field writes it."""

    kind: int
    stream_id: int
    data: bytes | list[bytes] = b""
    text: str = ""
    num: int = 0
    text2: str = ""
    text3: str = ""
    text4: str = ""


async def test_the_traceparent_reaches_the_handler(plane: Plane) -> None:
    seen: list[tuple[str, str]] = []

    async def handler(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        seen.append((ctx.request_id, ctx.traceparent))
        yield b"ok"

    plane.server.register("ns/c/trace", handler)
    for ctx in (RequestContext("traced", TRACEPARENT), RequestContext("plain")):
        items = [i async for i in plane.client.stream(plane.address, "ns/c/trace", b"", ctx)]
        assert items == [b"ok"]
    assert seen == [("traced", TRACEPARENT), ("plain", "")]


def test_a_request_frame_carries_the_traceparent_through_writer_and_reader() -> None:
    writer = FrameWriter()
    frame = Frame(int(Kind.REQUEST), 7, b"payload", "ns/c/e", 0, "rid", TRACEPARENT)
    writer.append(frame)
    assert FrameReader().feed(bytes(writer.take())) == [frame]


def test_a_peer_without_the_field_reads_a_traced_request_and_is_read_untraced() -> None:
    traced = Frame(int(Kind.REQUEST), 7, b"payload", "ns/c/e", 0, "rid", TRACEPARENT)
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(traced), type=FrameBeforeTrace)
    assert old == FrameBeforeTrace(int(Kind.REQUEST), 7, b"payload", "ns/c/e", 0, "rid")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=Frame)
    assert back == Frame(int(Kind.REQUEST), 7, b"payload", "ns/c/e", 0, "rid")
    assert back.text3 == ""


def test_a_peer_with_a_further_field_is_read_with_its_traceparent() -> None:
    newer = FrameAfterTrace(int(Kind.REQUEST), 7, b"p", "ns/c/e", 0, "rid", TRACEPARENT, "more")
    frame = msgspec.msgpack.decode(msgspec.msgpack.encode(newer), type=Frame)
    assert frame.text3 == TRACEPARENT and frame.text2 == "rid"
