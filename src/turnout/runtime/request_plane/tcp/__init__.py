"""The ``tcp`` request plane: one multiplexed connection per peer, length-prefixed msgpack frames.

See ``framing`` for the frames and the exchange of one stream. The pieces:

* ``_Connection`` (``connection``): an ``asyncio.Protocol`` shared by both ends. Outgoing
  frames are encoded into one buffer and written once per event-loop iteration
  (``call_soon``), so a burst of tokens from many streams costs one ``write`` syscall, not one
  per frame. On the server, the items one stream produced within the iteration also share one
  DATA frame.
* Server side (``server``), each REQUEST runs its handler in a task that spends one credit per
  DATA frame and waits when it has none; the client returns credit as it consumes. A slow
  consumer thus stops its handler at most ``WINDOW`` items ahead, and memory stays bounded.
* Client side (``client``), a stream's frames land in an ``Inbox`` (a deque and one waiter)
  owned by the connection; the iterator handed to the caller (``_TcpStream``, a
  ``CreditedStream``) reads it, so dropping the iterator can cancel the stream (the
  connection holds the inbox, not the iterator).
* Both ends heartbeat a connection with open streams that wrote nothing for a second, and
  drop one that heard nothing for their idle timeout (``connection``).

Error mapping on the client: nothing sent or REJECT -> ``PeerUnavailable``; connection lost
before ACK -> ``PeerUnavailable``, after ACK or ABORT -> ``StreamBroken``; ERROR ->
``RemoteError``.
"""

from __future__ import annotations

from turnout.runtime.request_plane.tcp.client import TcpClient, split_address
from turnout.runtime.request_plane.tcp.server import TcpServer

__all__ = ["TcpClient", "TcpServer", "split_address"]
