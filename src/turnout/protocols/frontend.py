"""What a frontend writes into the discovery store about itself.

Key layout (a wire format; keep it stable)::

    v1/frontends/{frontend_id:x}   -> FrontendRecord

Written under the frontend's own lease (its id is the lease id), so the record vanishes with
the process. It says who the frontend is (``ProcessIdentity``: host, pid, version, planes),
where it listens, how it routes, and which instances it holds back from routing and why:
``turnout status`` shows them, and a worker starting on other planes finds out at once.
"""

from __future__ import annotations

import enum

import msgspec

from turnout.protocols.model import ProcessIdentity

FRONTENDS_ROOT = "v1/frontends"
#: Held-back entries one record lists; past it the record says how many more there are.
MAX_HELD_BACK = 64


def frontend_key(frontend_id: int) -> str:
    return f"{FRONTENDS_ROOT}/{frontend_id:x}"


class HoldReason(enum.StrEnum):
    """Why a frontend routes no request to an instance it sees."""

    #: The instance's model card differs from the served one (a rolling upgrade, or a
    #: misconfigured worker): it waits as standby until the served card's instances leave.
    CARD_DIFFERS = "card_differs"
    #: The instance runs another request or event plane than the frontend: refused.
    PLANES_DIFFER = "planes_differ"


#: Namespaces whose frontend serves the models of every namespace: the empty one (no
#: namespace given) and ``"global"``. Any other name serves only its own namespace.
GLOBAL_NAMESPACES = frozenset({"", "global"})


def is_global_namespace(namespace: str | None) -> bool:
    """True when a frontend in ``namespace`` sees every namespace's models."""
    return namespace is None or namespace in GLOBAL_NAMESPACES


class HeldBackCard(msgspec.Struct, frozen=True, kw_only=True):
    """One instance a frontend holds back, and why."""

    model: str
    #: Hex, as every output prints instance ids.
    instance_id: str
    #: The instance's card checksum (``ModelDeploymentCard.checksum``).
    checksum: str
    reason: HoldReason
    #: The reason in words (the served checksum, or the planes on both sides).
    detail: str = ""


class FrontendRecord(ProcessIdentity, frozen=True, kw_only=True):
    """One running frontend; see the module docstring."""

    frontend_id: int
    #: Where its HTTP server listens (``http://host:port``).
    http_address: str = ""
    router_mode: str = ""
    #: The namespace it serves (None: every namespace).
    namespace: str | None = None
    #: At most ``MAX_HELD_BACK`` entries, sorted by model then instance id.
    held_back: list[HeldBackCard] = msgspec.field(default_factory=list)
    #: How many it holds back in all (more than ``len(held_back)`` when the list is cut).
    held_back_total: int = 0

    def key(self) -> str:
        return frontend_key(self.frontend_id)

    def serves_namespace(self, namespace: str) -> bool:
        """Whether this frontend watches the models of ``namespace``."""
        return is_global_namespace(self.namespace) or self.namespace == namespace
