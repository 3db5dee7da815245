"""Helpers for tests, benchmarks and the demo server: tiny random checkpoints, no downloads."""
