"""What the model watcher tells the HTTP service: which kinds of request are served.

The watcher (``frontend.models.watcher``) puts a ``ModelUpdate`` on its queue whenever a
model with some request types is registered (``Added``) or the last model of one type goes
(``Removed``), so the service can follow without reading the ``ModelManager`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from turnout.protocols.model import ModelType

__all__ = ["ModelAdded", "ModelRemoved", "ModelUpdate"]


@dataclass(frozen=True, slots=True)
class ModelUpdate:
    """A change in which kinds of request are served, for the HTTP service to follow.

    Either ``ModelUpdate.Added(model_type)`` (an instance of a model with these types was
    registered; ``model_type`` may hold several flags, as the card does) or
    ``ModelUpdate.Removed(model_type)`` (no model serves this single type any more).
    """

    model_type: ModelType

    Added: ClassVar[type[ModelAdded]]
    Removed: ClassVar[type[ModelRemoved]]


@dataclass(frozen=True, slots=True)
class ModelAdded(ModelUpdate):
    pass


@dataclass(frozen=True, slots=True)
class ModelRemoved(ModelUpdate):
    pass


ModelUpdate.Added = ModelAdded
ModelUpdate.Removed = ModelRemoved
