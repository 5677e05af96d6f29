"""Timers and memory readings: what a record measures, without a host sync."""
