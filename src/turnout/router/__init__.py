"""Routing: which instance serves a request (round-robin, random, ..., KV-aware)."""
