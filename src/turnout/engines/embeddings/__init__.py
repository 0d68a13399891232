"""Embedding models served by a worker (``turnout worker --engine embeddings``)."""

from .engine import EmbeddingEngine

__all__ = ["EmbeddingEngine"]
