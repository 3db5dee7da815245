"""Observability: Prometheus metrics, the engine log line, and the live wall verdict per step."""
