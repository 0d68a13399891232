"""Reading model-card records from the discovery store, and saying once why one is refused.

Nothing in a card is trusted: whoever can write the store can write one. The model watcher
(``frontend.models.watcher``) reads each record through here before anything is built from
it:

* ``card_lane_name`` reads only the model name of a record, cheaply, to queue its event
  behind the same model's earlier ones;
* ``decode_card`` decodes the whole card, or logs why it cannot (one error line, the value
  cut short) and returns None;
* ``RefusalLog`` logs a refused card (numbers out of range, a chat template that spins, an
  unsupported pair) with one error line naming the model, the instance and the field, once
  per model and reason: the next instances of the same card are refused at debug level, so a
  fleet of bad workers does not flood the log.

Every line goes to the model watcher's logger, whichever of its modules writes it: operators'
log filters name that one logger.
"""

from __future__ import annotations

import logging

import msgspec

from turnout.frontend.models.pairs import InvalidCard
from turnout.protocols.model import ModelDeploymentCard

__all__ = ["WATCHER_LOGGER", "RefusalLog", "card_lane_name", "decode_card"]

#: The logger of the model watcher and of every module it is split into.
WATCHER_LOGGER = "turnout.frontend.models.watcher"

log = logging.getLogger(WATCHER_LOGGER)

#: Distinct refusal messages (unsupported pairs, invalid cards) remembered so each is logged
#: once (bounded: past it, forgotten and logged again).
MAX_LOGGED_REFUSALS = 1024


class _CardName(msgspec.Struct):
    """The part of a card that says which model's events it belongs with."""

    display_name: str


_card_name_decoder = msgspec.json.Decoder(_CardName)


def card_lane_name(value: bytes) -> str | None:
    """The model name a card record announces, or None when the value is not a card."""
    try:
        return _card_name_decoder.decode(value).display_name
    except msgspec.DecodeError:
        return None


def decode_card(key: str, value: bytes) -> ModelDeploymentCard | None:
    """The card stored under ``key``, or None (logged as an error) when it is not one."""
    try:
        return msgspec.json.decode(value, type=ModelDeploymentCard)
    except msgspec.DecodeError as err:
        hint = ""
        if "$.tokenizer" in str(err):
            # A card that names its tokenizer by path, not as a content-addressed artifact.
            hint = " (its tokenizer must be a content-addressed artifact: upgrade the worker)"
        log.error("invalid model card key=%s error=%s%s value=%.200r", key, err, hint, value)
        return None


class RefusalLog:
    """The refusals already logged, by model and message (bounded by
    ``MAX_LOGGED_REFUSALS``), so that each is an error line once and debug after."""

    def __init__(self) -> None:
        self._logged: set[tuple[str, str]] = set()

    def first_sight(self, name: str, err: Exception) -> bool:
        """True the first time this refusal of ``name`` is seen (it is then logged as an
        error; later instances of the same card only at debug level)."""
        seen = (name, str(err))
        if seen in self._logged:
            return False
        if len(self._logged) >= MAX_LOGGED_REFUSALS:
            self._logged.clear()
        self._logged.add(seen)
        return True

    def refuse(self, key: str, card: ModelDeploymentCard, err: InvalidCard) -> None:
        """Log the refusal of an invalid card: an error the first time for its model and
        reason, debug after."""
        name = card.display_name
        if self.first_sight(name, err):
            log.error(
                "model card refused: model=%s instance=%x key=%s field=%s: %s",
                name,
                card.instance_id,
                key,
                err.field,
                err.reason,
            )
        else:
            log.debug("model card refused again model=%s key=%s field=%s", name, key, err.field)
