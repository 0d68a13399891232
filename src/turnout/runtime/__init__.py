"""Distributed runtime: discovery store, leases, request plane, event plane, components."""
