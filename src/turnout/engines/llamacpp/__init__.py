"""A GGUF model served in process by llama.cpp's server core (``xllamacpp``), on CPU:
``engine.LlamaCppEngine``; see its module for how the parts fit."""
