"""Per-model metrics of the embedding / reranker models and their dynamic batchers (issue 18),
in the same registry and naming scheme as the rest of /metrics (`stoker:` where vLLM has no
name), one `model_name` label per served model (its first served name):

    stoker:pooling_requests_total{model_name, outcome}   requests: ok, queue_full, timeout, refused
    stoker:pooling_inputs_total{model_name}              inputs embedded / scored
    stoker:pooling_batch_size{model_name}                inputs per batch the batcher ran (histogram)
    stoker:pooling_batch_tokens{model_name}              tokens per batch (histogram)
    stoker:pooling_queue_time_seconds{model_name}        per batch: the oldest input's wait before dispatch
    stoker:pooling_batch_seconds{model_name}             per batch: the forward (dispatch to result)

`stoker bench serve --endpoint embeddings` differences `stoker:pooling_batch_size` over its run.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from stoker.pooling.batcher import BatchRecord

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)
_TIME_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)


class PoolingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        ln = ["model_name"]
        self.requests = Counter("stoker:pooling_requests", "Embedding / rerank / score requests by outcome",
                                ["model_name", "outcome"], registry=registry)
        self.inputs = Counter("stoker:pooling_inputs", "Inputs embedded or scored", ln, registry=registry)
        self.batch_size = Histogram("stoker:pooling_batch_size", "Inputs per batch the dynamic batcher ran", ln,
                                    buckets=_SIZE_BUCKETS, registry=registry)
        self.batch_tokens = Histogram("stoker:pooling_batch_tokens", "Tokens per batch", ln, buckets=_TOKEN_BUCKETS,
                                      registry=registry)
        self.queue_time = Histogram("stoker:pooling_queue_time_seconds",
                                    "Per batch: how long its oldest input waited before dispatch", ln,
                                    buckets=_TIME_BUCKETS, registry=registry)
        self.batch_time = Histogram("stoker:pooling_batch_seconds", "Per batch: dispatch to result (the forward)", ln,
                                    buckets=_TIME_BUCKETS, registry=registry)

    def on_batch(self, model_name: str, record: BatchRecord) -> None:
        """The batcher's callback (event loop), once per batch run."""
        self.inputs.labels(model_name).inc(record.size)
        self.batch_size.labels(model_name).observe(record.size)
        self.batch_tokens.labels(model_name).observe(record.num_tokens)
        self.queue_time.labels(model_name).observe(max(record.dispatched - record.oldest_arrival, 0.0))
        self.batch_time.labels(model_name).observe(max(record.finished - record.dispatched, 0.0))

    def on_request(self, model_name: str, outcome: str) -> None:
        self.requests.labels(model_name, outcome).inc()
