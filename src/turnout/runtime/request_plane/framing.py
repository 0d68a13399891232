"""Frames of the tcp request plane: a 4-byte big-endian length, then one msgpack ``Frame``.

One connection carries many streams, told apart by ``stream_id`` (chosen by the client)::

    client                                   server
    REQUEST(sid, text=path, data=payload, text2=request id, text3=traceparent) ──▶
                                      ◀── ACK(sid)        the handler runs: from now on a
                                                          lost connection is StreamBroken
                                      ◀── DATA(sid, item | [items]) x n  (<= WINDOW unconsumed)
    CREDIT(sid, num=k) ──▶                                after the client consumed k items
                                      ◀── END(sid) | ERROR(sid, text=message)
                                          | ABORT(sid)    (server cancelled: StreamBroken)
                                          | REJECT(sid)   (not accepting: PeerUnavailable)
    CANCEL(sid) ──▶                                       client gave up: cancel the handler
    HEARTBEAT(0) ◀──▶                                     either end, on a connection it
                                                          wrote nothing on for 1 s with
                                                          streams open (liveness, see
                                                          tcp.connection)

Frames are msgpack arrays (``array_like``) of their fields in order. A reader takes an array
cut short as a frame whose missing trailing fields have their defaults: a DATA frame of one
small item is written that way, ``[2, sid, item]`` (``FrameWriter.append_data``), three small
headers around the item's bytes.
"""

from __future__ import annotations

import enum
import struct

import msgspec

from turnout.errors import ConfigError

#: Items a handler may run ahead of its consumer (the per-stream credit window).
WINDOW = 64
#: The client returns credit in batches of this many consumed items.
CREDIT_BATCH = WINDOW // 4
#: The default bound on one frame (``--max-frame-bytes``). A frame announcing more is refused
#: from its 4-byte header, before any of its bytes is read, and its connection is dropped: an
#: unauthenticated peer must not make a process buffer what it likes. Sized on the largest
#: legitimate frames, with room to spare:
#:
#: * a request: the token ids of a prompt (bounded by the context length: 5 msgpack bytes a
#:   token at most, 5 MiB for a 1M-token context) plus what came in the HTTP body (a
#:   structured-output grammar, a text-mode request, images: the frontend's 16 MiB body cap);
#: * a reply item: an embeddings reply of 2048 inputs (OpenAI's limit, the frontend's) x 4096
#:   float32 dimensions is 32 MiB; artifacts travel in 256 KiB chunks (``iter_chunks``), tokens
#:   in a few bytes each. Items batched into one DATA frame are split at the bound.
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
#: Smaller bounds are refused as a setting: an artifact chunk and its frame must fit.
MIN_MAX_FRAME_BYTES = 1024 * 1024
#: Bytes of a DATA frame around its items: the header, the frame's fields, and the msgpack
#: array and bin headers of up to ``WINDOW`` items (5 bytes each at most).
FRAME_OVERHEAD = 64 + 5 * WINDOW

HEADER = struct.Struct(">I")
#: A DATA frame's bytes before its item (see ``FrameWriter.append_data``): the length, a
#: 3-element msgpack array, the kind, the stream id (a fixint, or a uint32: msgpack lets an
#: integer take more bytes than it needs), a bin8 header.
_DATA_SMALL_ID = struct.Struct(">IBBBBB")
_DATA_LARGE_ID = struct.Struct(">IBBBIBB")


class Kind(enum.IntEnum):
    REQUEST = 0
    ACK = 1
    DATA = 2
    END = 3
    ERROR = 4
    CANCEL = 5
    CREDIT = 6
    REJECT = 7
    ABORT = 8
    #: ``nats`` only: one piece of an item too large for one message; the item's last piece
    #: follows as a DATA frame holding that item alone.
    PART = 9
    #: "Still here". ``nats``: from the server, per stream, ``num`` = the last sequence number
    #: sent; ``tcp``: from either end, per connection (stream id 0), sent on a connection with
    #: open streams that was silent for a heartbeat interval.
    HEARTBEAT = 10


class Frame(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    kind: int
    stream_id: int
    #: REQUEST: the payload; DATA: one response item, or several in order (the items a
    #: handler produced within one event-loop iteration travel as one frame).
    data: bytes | list[bytes] = b""
    #: REQUEST: the endpoint path; ERROR / REJECT: the message.
    text: str = ""
    #: CREDIT: how many items were consumed (``nats``: in total, since the stream began);
    #: ``nats`` server frames: their sequence number within the stream (gaps are detected).
    num: int = 0
    #: REQUEST: the request id, so the server's logs name the same request.
    text2: str = ""
    #: REQUEST: the W3C ``traceparent`` of the span that sent it ("": not traced). A peer
    #: that predates the field ignores it (msgspec drops an array's extra trailing items).
    text3: str = ""


class FrameError(Exception):
    """The byte stream is not a valid frame sequence; the connection must be dropped."""


class FrameTooLarge(FrameError):
    """A frame header announced more than the bound: refused before its bytes are read."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


def check_max_frame_bytes(value: int) -> int:
    """``value`` if it is a usable frame bound, else ``ConfigError`` naming the flag."""
    if value < MIN_MAX_FRAME_BYTES:
        raise ConfigError(
            f"--max-frame-bytes must be at least {MIN_MAX_FRAME_BYTES} (1 MiB), got {value}"
        )
    if value > 0xFFFF_FFFF:
        raise ConfigError(f"--max-frame-bytes must fit the 4-byte frame length, got {value}")
    return value


def split_items(items: list[bytes], budget: int) -> list[list[bytes]]:
    """``items`` cut, in order, into runs whose sizes add up to at most ``budget`` each, so
    that a DATA frame batching a run stays within the frame bound. Every item must be at
    most ``budget`` itself."""
    runs: list[list[bytes]] = []
    run: list[bytes] = []
    size = 0
    for item in items:
        n = len(item)
        if run and size + n > budget:
            runs.append(run)
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        runs.append(run)
    return runs


class FrameWriter:
    """Accumulates encoded frames in one buffer, taken whole for one ``transport.write``."""

    __slots__ = ("_buf", "_encode_into")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._encode_into = msgspec.msgpack.Encoder().encode_into

    def __len__(self) -> int:
        return len(self._buf)

    def append(self, frame: Frame) -> None:
        buf = self._buf
        start = len(buf)
        buf += b"\0\0\0\0"
        self._encode_into(frame, buf, -1)
        HEADER.pack_into(buf, start, len(buf) - start - 4)

    def append_data(self, stream_id: int, item: bytes) -> None:
        """``append(Frame(DATA, stream_id, item))`` for the frame of one token, most of what
        a stream sends: an item under 256 bytes of a stream id under 2**32 is written as
        ``[2, stream_id, item]`` by hand (one ``struct`` call instead of making and encoding
        the struct: about a third less CPU), which any msgspec reader decodes as that frame
        (trailing fields left out take their defaults); anything else goes through
        ``append``."""
        n = len(item)
        if n < 0x100 and stream_id >= 0:  # a client may pick a negative id: the slow path
            if stream_id < 0x80:
                self._buf += _DATA_SMALL_ID.pack(n + 5, 0x93, 2, stream_id, 0xC4, n)
                self._buf += item
                return
            if stream_id < 0x1_0000_0000:
                self._buf += _DATA_LARGE_ID.pack(n + 9, 0x93, 2, 0xCE, stream_id, 0xC4, n)
                self._buf += item
                return
        self.append(Frame(int(Kind.DATA), stream_id, item))

    def take(self) -> bytearray:
        """The bytes written so far; the writer starts a fresh buffer (the transport may keep
        a reference to the one it was given, so it is never reused)."""
        buf = self._buf
        self._buf = bytearray()
        return buf


class FrameReader:
    """Cuts frames out of the received byte stream; keeps an incomplete tail for later.

    A frame is checked against ``max_frame_bytes`` as soon as its 4-byte header is in
    (``FrameTooLarge``), and its buffer only ever holds the bytes that arrived: nothing is
    allocated from an announced length, which a peer may choose to lie about.
    """

    __slots__ = ("_decode", "_tail", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._tail = bytearray()
        self._decode = msgspec.msgpack.Decoder(Frame).decode

    @property
    def buffered(self) -> int:
        """Bytes received and kept for a frame not complete yet."""
        return len(self._tail)

    def feed(self, data: bytes) -> list[Frame]:
        # Common case: the chunk holds whole frames and nothing is pending, so it is parsed
        # in place; a pending tail grows in place (amortised), never by re-concatenation.
        tail = self._tail
        buf: bytes | bytearray
        if tail:
            tail += data
            buf = tail
        else:
            buf = data
        frames: list[Frame] = []
        pos = 0
        end = len(buf)
        decode = self._decode
        limit = self.max_frame_bytes
        with memoryview(buf) as view:
            while end - pos >= 4:
                (size,) = HEADER.unpack_from(buf, pos)
                if size > limit:
                    raise FrameTooLarge(size, limit)
                if end - pos - 4 < size:
                    break
                try:
                    frames.append(decode(view[pos + 4 : pos + 4 + size]))
                except msgspec.DecodeError as exc:
                    raise FrameError(f"undecodable frame: {exc}") from exc
                pos += 4 + size
        if buf is tail:
            del tail[:pos]
        elif pos < end:
            tail += data[pos:]
        return frames
