"""Admission control: how many requests run at once, and each model's busy thresholds."""
