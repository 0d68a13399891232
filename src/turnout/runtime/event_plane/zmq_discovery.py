"""How subscribers find zmq event publishers: the records publishers keep in the discovery store.

``v1/event_publishers/{namespace}/{component}/{publisher id:x}`` holds an
``EventPublisherRecord`` (JSON) under the publisher's lease; see ``zmq`` for the whole plane.
"""

from __future__ import annotations

import msgspec

from turnout.runtime.event_plane.curve import Attestation

#: Root of the publishers' records in the discovery store (a wire format: keep it stable).
PUBLISHERS_ROOT = "v1/event_publishers"


class EventPublisherRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a publisher writes at ``publishers_key``; JSON in the store. ``attestation``:
    its Curve key's, with plane credentials only (absent from the JSON otherwise)."""

    address: str
    publisher_id: int
    namespace: str
    component: str
    hostname: str = ""
    pid: int = 0
    attestation: Attestation | None = None


record_decoder = msgspec.json.Decoder(EventPublisherRecord)


def publishers_prefix(namespace: str, component: str) -> str:
    """The prefix a subscriber watches (the trailing ``/`` keeps ``kv`` apart from ``kv2``)."""
    return f"{PUBLISHERS_ROOT}/{namespace}/{component}/"


def publishers_key(namespace: str, component: str, publisher_id: int) -> str:
    return f"{publishers_prefix(namespace, component)}{publisher_id:x}"
