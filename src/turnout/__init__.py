"""turnout: a distributed LLM inference serving layer.

Layers import only downwards::

    protocols  <-  runtime  <-  llm / router  <-  frontend / engines  <-  cli
"""

__version__ = "0.1.0"
