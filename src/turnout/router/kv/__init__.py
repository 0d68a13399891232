"""KV-cache-aware routing: block hashing, the indexer, active sequences, selection."""
