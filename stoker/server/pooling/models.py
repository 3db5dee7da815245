"""The pooling models a server holds: each with its tokenizer thread, its instances (worker
threads, each running whole batches: stoker/pooling/instances.py) and its dynamic batcher. A
registry by served name, so one server can hold several (`stoker serve --config`); routes look
models up by `model`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from stoker.pooling.config import PoolingConfig
from stoker.pooling.batcher import BatchRecord, BatcherConfig, DynamicBatcher
from stoker.server.errors import ApiError

logger = logging.getLogger("stoker.server")

# A request whose texts total at most this many characters is tokenized on the event loop, not
# handed to the tokenizer thread: the hand-off cost the loop more than the Rust encode does (the
# loop's CPU per query at c = 32 fell from 570-612 to 502-512 us with it), and the request no
# longer queues behind the others' (a query had waited 5.6 ms there for ~0.1 ms of work;
# docs/benchmarks.md, "Event-loop CPU per request"). Longer requests keep the thread, so a 2048-passage
# request never stalls the loop.
INLINE_TOKENIZE_CHARS = 2048
# Texts on which a tokenizer's inline encoder must give what its transformers call gives.
_PROBES = ["Hello, world!", "  leading and trailing spaces  ", "naïve café — 東京 ☃", "a\tb\nc", "[CLS] [SEP] <s> </s>",
           "don't stop", "1234567890 3.14159", ""]


@dataclass(frozen=True)
class PoolingModelSpec:
    """What to load and how to serve it (`stoker serve` flags, or a model-repository entry)."""

    path: str
    names: tuple[str, ...]
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    instance_count: int | None = None  # Triton's instance_group count; None: by device (stoker/pooling/instances.py)

    def __post_init__(self) -> None:
        if self.instance_count is not None and self.instance_count < 1:
            raise ValueError(f"--instance-count must be >= 1, got {self.instance_count}")


@dataclass
class PoolingModel:
    spec: PoolingModelSpec
    config: PoolingConfig
    runner: Any  # pooling.runner.PoolingRunner (torch): kept out of this module's imports
    tokenizer: Any  # used only on `tokenizer_thread` (HF tokenizers are not shared across threads)
    vocab_size: int
    tokenizer_thread: ThreadPoolExecutor
    worker: ThreadPoolExecutor  # the model's instances: one thread each, every forward runs on one
    batcher: DynamicBatcher | None = None
    batch_sizes: collections.Counter = field(default_factory=collections.Counter)
    recent_batches: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))
    metrics: Any = None  # server/pooling/metrics.py PoolingMetrics, set by the server
    inline_encoder: Any = None  # inline_encoder(tokenizer): used only on the event loop

    def encode_inline(self, texts: list[str], add_special_tokens: bool) -> list[list[int]] | None:
        """The texts' token ids computed here, on the event loop, or None: the request is for
        the tokenizer thread (no inline encoder, or longer than INLINE_TOKENIZE_CHARS)."""
        if self.inline_encoder is None or sum(map(len, texts)) > INLINE_TOKENIZE_CHARS:
            return None
        return [self.inline_encoder.encode(t, add_special_tokens=add_special_tokens).ids for t in texts]

    @property
    def names(self) -> tuple[str, ...]:
        return self.spec.names

    @property
    def num_instances(self) -> int:
        """The loaded spec's count (load_pooling_model resolves None by device)."""
        return self.spec.instance_count or 1

    def _record(self, record: BatchRecord) -> None:
        self.batch_sizes[record.size] += 1
        self.recent_batches.append(record)
        if self.metrics is not None:
            self.metrics.on_batch(self.names[0], record)

    def start(self) -> None:
        """On the event loop: start the batcher."""
        self.batcher = DynamicBatcher(self.runner.run_rows, self.spec.batcher, self.worker, on_batch=self._record,
                                      num_instances=self.num_instances)
        self.batcher.start()

    async def tokenize(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, self.tokenizer, *args)

    async def stop(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()
        # not waited for on the event loop: a batch still running finishes on its own thread
        self.worker.shutdown(wait=False)
        self.tokenizer_thread.shutdown(wait=False)


def inline_encoder(tokenizer: Any) -> Any | None:
    """A copy of a fast tokenizer's Rust tokenizer with truncation and padding off (a private
    copy: transformers sets those on its own per call, which is why the tokenizer itself stays
    on one thread), or None: a slow tokenizer, or one whose transformers call does more than
    the Rust encode on the probe texts (then every request takes the tokenizer thread)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    encoder = Tokenizer.from_str(backend.to_str())
    encoder.no_truncation()
    encoder.no_padding()
    for add_special in (True, False):
        want = tokenizer(_PROBES, add_special_tokens=add_special)["input_ids"]
        if [encoder.encode(t, add_special_tokens=add_special).ids for t in _PROBES] != want:
            logger.info("%s: its transformers tokenizer differs from the Rust encode; every request is "
                        "tokenized on the tokenizer thread", type(tokenizer).__name__)
            return None
    return encoder


def load_pooling_model(spec: PoolingModelSpec) -> PoolingModel:
    """Blocking (weights, tokenizer): call it off the event loop, on a thread that then ends
    (PoolingModels.load), so that only the instances' threads keep OpenMP teams (a second team
    busy beside the first slows it: docs/benchmarks.md, "Server overhead")."""
    import dataclasses
    import json
    from pathlib import Path

    import torch

    from stoker.engine.tokenizer import load_tokenizer
    from stoker.pooling.instances import instance_executor, resolve_instance_count, threads_per_instance
    from stoker.pooling.runner import PoolingRunner
    from stoker.pooling.batch_defaults import preferred_batch_tokens

    runner = PoolingRunner.from_folder(spec.path, spec.dtype, spec.device, spec.max_model_len)
    hf_config = json.loads((Path(spec.path) / "config.json").read_text())
    batcher = spec.batcher
    if not batcher.preferred_batch_size and batcher.preferred_batch_tokens is None:
        device = runner.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[next(runner.model.parameters()).dtype]
        # on a CPU with no device file, measure it, but only where a preferred size matters:
        # with no queue delay a batch goes whenever an instance is free, whatever its size
        from stoker.doctor.device import quick_cpu_device

        measure = quick_cpu_device if batcher.max_queue_delay_microseconds > 0 else None
        tokens = preferred_batch_tokens(hf_config, name, dtype, measure_cpu=measure)
        batcher = dataclasses.replace(batcher, preferred_batch_tokens=tokens)
        if tokens:
            why = f"{tokens} tokens (the roofline's weight-bound edge)"
        elif not batcher.max_queue_delay_microseconds:
            why = (f"none (no --max-queue-delay-microseconds: a batch of what waits, up to --max-batch-size "
                   f"{batcher.max_batch_size}, goes whenever an instance is free)")
        else:
            why = f"none known for this device (batches up to --max-batch-size {batcher.max_batch_size})"
        logger.info("batcher for %s: preferred batch %s", spec.names[0], why)
    num_threads = torch.get_num_threads()
    num_instances = resolve_instance_count(spec.instance_count, runner.device, num_threads)
    per_instance = threads_per_instance(num_instances, num_threads)
    logger.info("%s: %d instance(s)%s", spec.names[0], num_instances,
                f" of {per_instance} CPU thread(s) each" if runner.device.type == "cpu" else f" on {runner.device}")
    spec = dataclasses.replace(spec, batcher=batcher, instance_count=num_instances)
    tokenizer = load_tokenizer(spec.path)
    return PoolingModel(spec, runner.config, runner, tokenizer, int(hf_config["vocab_size"]),
                        ThreadPoolExecutor(1, thread_name_prefix="stoker-tokenize"),
                        instance_executor(num_instances, per_instance), inline_encoder=inline_encoder(tokenizer))


class PoolingModels:
    """The served pooling models; `ready` once every one has loaded."""

    def __init__(self, specs: list[PoolingModelSpec],
                 loader: Callable[[PoolingModelSpec], PoolingModel] = load_pooling_model) -> None:
        self.specs, self.loader = specs, loader
        self.names: tuple[str, ...] = tuple(n for s in specs for n in s.names)  # asked on every request
        self.models: list[PoolingModel] = []
        self.ready = False
        self.metrics: Any = None  # PoolingMetrics, shared by the models (each labels its own name)

    async def load(self) -> None:
        for spec in self.specs:
            loading = ThreadPoolExecutor(1, thread_name_prefix="stoker-pooling-load")
            try:
                model = await asyncio.get_running_loop().run_in_executor(loading, self.loader, spec)
            finally:
                loading.shutdown(wait=False)
            model.metrics = self.metrics
            model.start()
            self.models.append(model)
            logger.info("ready: serving %s as %s (%s, %s pooling, max_model_len %d)", spec.path, ", ".join(spec.names),
                        model.config.kind, model.config.pooling, model.config.max_model_len)
        self.ready = True

    def get(self, name: str | None, retry_after_s: int = 1) -> PoolingModel:
        if name is not None and name not in self.names:
            raise ApiError(404, f"The model `{name}` does not exist. Served: {', '.join(self.names)}", "model")
        if not self.ready:
            raise ApiError(503, "the model is still loading; retry when /v1/health/ready answers 200",
                           headers={"Retry-After": str(retry_after_s)})
        return next(m for m in self.models if name is None or name in m.names)

    async def shutdown(self) -> None:
        self.ready = False
        for model in self.models:
            await model.stop()


async def load_pooling(state: Any, on_fatal: Callable[[BaseException], None] | None) -> None:
    """The app's start-up task for `state.pooling`: a failure is the server's (as a model that
    fails to load stops `stoker serve`)."""
    try:
        from stoker.server.pooling.metrics import PoolingMetrics

        state.pooling.metrics = PoolingMetrics(state.metrics.registry)
        await state.pooling.load()
    except Exception as exc:  # noqa: BLE001 - logged, then the server stops
        logger.exception("loading a pooling model failed")
        state.load_error = exc
        if on_fatal is not None:
            on_fatal(exc)
