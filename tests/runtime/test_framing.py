"""The tcp plane's frame writer: a DATA frame written by hand reads back as the frame it
stands for, at every size of stream id (a client may pick a negative one) and item, and both
ways of writing one mix freely."""

from __future__ import annotations

import pytest

from turnout.runtime.request_plane.framing import Frame, FrameReader, FrameWriter, Kind

STREAM_IDS = [-(2**63), -1, 0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63]
ITEM_SIZES = [0, 1, 255, 256, 65535, 65536]


@pytest.mark.parametrize("stream_id", STREAM_IDS)
@pytest.mark.parametrize("size", ITEM_SIZES)
def test_append_data_reads_back_as_the_data_frame(stream_id: int, size: int) -> None:
    writer = FrameWriter()
    item = bytes(range(256)) * (size // 256) + bytes(size % 256)
    writer.append_data(stream_id, item)
    assert FrameReader().feed(bytes(writer.take())) == [Frame(Kind.DATA, stream_id, item)]


def test_hand_written_and_encoded_frames_interleave_in_one_buffer() -> None:
    writer = FrameWriter()
    frames = [
        Frame(Kind.ACK, 5),
        Frame(Kind.DATA, 5, b"a"),
        Frame(Kind.DATA, 5, [b"b", b"c"]),
        Frame(Kind.DATA, 300, b"d" * 300),
        Frame(Kind.END, 5),
    ]
    for frame in frames:
        if frame.kind == Kind.DATA and isinstance(frame.data, bytes):
            writer.append_data(frame.stream_id, frame.data)
        else:
            writer.append(frame)
    data = bytes(writer.take())
    reader = FrameReader()
    # Fed in pieces that cut frames anywhere: the reader keeps what is incomplete.
    got = [f for i in range(0, len(data), 7) for f in reader.feed(data[i : i + 7])]
    assert got == frames and reader.buffered == 0
