"""Pooling: /v1/embeddings, /v1/rerank and /v1/score over embedding and reranker models."""
