"""The frontend's Prometheus metrics."""
