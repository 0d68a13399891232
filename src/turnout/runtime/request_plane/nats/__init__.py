"""The ``nats`` request plane: streams between instances through a NATS server.

Subjects::

    turnout.rp.<server id>              each server's one subscription (its TransportAddress)
    turnout.rpc.<client id>.<stream>    one reply subject per stream; a client subscribes to
                                        turnout.rpc.<client id>.* once

Every message is one msgpack ``Frame`` (see ``framing``), as on tcp, with no length prefix
(NATS delimits messages), or a batch: a msgpack array of frames. The client publishes REQUEST,
CREDIT and CANCEL to the server's subject with the stream's reply subject as the NATS reply;
the server answers with ACK, DATA, PART, HEARTBEAT and one of END / ERROR / REJECT / ABORT.

* **Batches.** A client's REQUEST sets ``TAKES_BATCHES`` in ``num``; the server then sends that
  stream's frames, with the stream id in ``stream_id``, in batch messages on the client's
  batch subject ``turnout.rpc.<client id>.0``, one per client for whatever its streams produced
  since the server's writer last ran. Without the bit (a client that does not know batches)
  each frame is a message of its own on the stream's reply subject, which a client that asks
  for batches reads as well (a server that does not know them ignores the bit): either end
  may be older than the other.

What NATS does not give, the frames add:

* **No responders.** A message published with a reply subject that no subscription takes is
  answered by the NATS server with a ``503`` status message on the reply subject: before ACK
  that is ``PeerUnavailable`` (no such server, or it stopped), after ACK ``StreamBroken``.
* **Losses.** NATS is at-most-once (a reconnect may drop messages). Server frames carry a
  sequence number per stream (``num``); a gap is ``StreamBroken``, never a silently shortened
  stream. Credit is cumulative (items consumed since the start), so a lost CREDIT is repaired
  by the next one, and the client repeats it every heartbeat interval.
* **Liveness.** The server sends a HEARTBEAT on every stream it has not written to for
  ``heartbeat_interval``; a client that hears nothing for ``idle_timeout`` ends the stream
  (``StreamBroken`` after ACK, ``PeerUnavailable`` before). The client's repeated CREDIT is its
  own heartbeat: a server that hears nothing from a stream's client for ``idle_timeout``
  cancels the handler. No wait is unbounded.
* **Back-pressure.** As on tcp: a handler runs at most ``WINDOW`` items ahead of its consumer.
* **Lost ACK.** Only a stream the server took gets DATA, PART, HEARTBEAT, END or ABORT, and its
  first frame (``num`` 1) is always the ACK: any of those proves the request was delivered even
  when the ACK itself was lost. A gap after that is ``StreamBroken`` (the handler ran), never
  ``PeerUnavailable``; the ACK alone missing is no gap at all.
* **Start-up.** A client subscribes to its reply subjects on first use and a server to its
  subject in ``start``; each waits at most ``idle_timeout`` for NATS to confirm. A failure is
  ``PeerUnavailable`` (client) or ``RequestPlaneError`` (server) and leaves nothing behind, so
  the next call starts over.
* **Size.** NATS caps a message at ``max_payload`` (1 MiB by default). Items produced within one
  event-loop iteration share a DATA frame up to that size; an item larger than a message is sent
  as PART frames and a last DATA frame, and reassembled. A request payload larger than one
  message is refused with ``RequestPlaneError`` (it never reaches a server). The text of an
  ERROR or REJECT frame (a handler's exception message may be anything) is truncated to fit.
  As on tcp, ``max_frame_bytes`` bounds an item: a larger one ends its stream with an ERROR
  on the server, and a client stops reassembling PARTs (``StreamBroken``) once they pass it,
  whatever a server sends; a request message over it is answered with an ERROR, undecoded.

Sends never await in the caller: frames go to an ``Outbox`` whose writer task publishes them
in order (and frames each stream's pending items at that moment, so a burst is one message).
"""

from __future__ import annotations

from turnout.runtime.request_plane.nats.client import NatsClient
from turnout.runtime.request_plane.nats.server import NatsServer

__all__ = ["NatsClient", "NatsServer"]
