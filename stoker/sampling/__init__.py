"""Batched sampling: penalties, filters, per-request seeds, logprobs."""
