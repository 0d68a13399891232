"""Engines: what runs behind a worker (echo, llamacpp, mocker; vllm and sglang adapters)."""
