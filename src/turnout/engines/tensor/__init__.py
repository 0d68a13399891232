"""Tensor models served by a worker (``turnout worker --engine numeric`` / ``onnx``)."""

from .base import TensorEngine
from .numeric import NumericEngine
from .onnx import OnnxTensorEngine

__all__ = ["NumericEngine", "OnnxTensorEngine", "TensorEngine"]
