"""`stoker serve` flags for pooling models: `--runner` (vLLM's) and the dynamic batcher's
knobs (Triton's names, in flag form: max_batch_size -> --max-batch-size)."""

from __future__ import annotations

import argparse
from typing import Any


def add_pooling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pooling models (embeddings, rerank) and their dynamic batcher")
    g.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="generate (completions, chat) or pooling (embeddings, rerank, score); auto: from config.json's "
                        "architectures and a sentence-transformers modules.json, as vLLM chooses")
    g.add_argument("--instance-count", type=int, default=None,
                   help="model instances, each running whole batches on its own thread, the CPU's threads split "
                        "between them (Triton's instance_group count); default: 2 on CPU (two single-threaded "
                        "forwards beat one two-thread forward on a small machine: docs/server.md), 1 on a GPU")
    g.add_argument("--max-batch-size", type=int, default=32, help="most inputs (sequences) in one forward (default 32)")
    g.add_argument("--preferred-batch-size", type=int, nargs="+", default=None,
                   help="batch sizes sent at once when the queue holds them (Triton's); default: as soon as the queued "
                        "tokens reach the roofline's weight-bound edge on this device, if known")
    g.add_argument("--max-queue-delay-microseconds", type=int, default=0,
                   help="longest an input waits for a fuller batch before its batch is sent (default 0: at once)")
    g.add_argument("--priority-levels", type=int, default=0,
                   help="request priority levels (1 highest); 0: none, requests may not send priority (default)")
    g.add_argument("--default-priority-level", type=int, default=None,
                   help="level of a request with priority 0 (default: the lowest, --priority-levels)")
    g.add_argument("--max-queue-size", type=int, default=0,
                   help="most inputs waiting; beyond it 503 + Retry-After (default 0: no limit)")
    g.add_argument("--default-timeout-microseconds", type=int, default=0,
                   help="an input still queued this long fails with 503 (default 0: no timeout)")


def _batcher_defaults() -> dict[str, Any]:
    p = argparse.ArgumentParser(add_help=False)
    add_pooling_args(p)
    return {a.dest: a.default for a in p._actions if a.dest not in ("help", "runner")}


_BATCHER_DEFAULTS = _batcher_defaults()  # the group's flags (all but --runner) and their defaults


def pooling_models_from_args(args: argparse.Namespace, model_path: str, names: tuple[str, ...]) -> Any:
    """The PoolingModels to serve when the folder (or --runner) says pooling; None for generation."""
    from stoker.pooling.config import resolve_runner
    from stoker.server.pooling.models import PoolingModels

    if args.model_dir is None or resolve_runner(model_path, args.runner) != "pooling":
        if args.runner == "pooling":
            raise ValueError("--runner pooling needs MODEL_DIR: the demo model is generative")
        given = [f"--{dest.replace('_', '-')}" for dest, default in _BATCHER_DEFAULTS.items()
                 if getattr(args, dest, default) != default]
        if given:  # a generative model has no dynamic batcher: refused, not ignored
            raise ValueError(f"{', '.join(given)}: dynamic-batcher flags apply to an embedding or reranker model; "
                             "this model is generative (scheduler flags: --max-num-seqs, --max-num-batched-tokens)")
        return None
    return PoolingModels([pooling_spec(args, model_path, names)])


def pooling_spec(args: argparse.Namespace, model_path: str, names: tuple[str, ...]) -> Any:
    """One PoolingModelSpec from the flags above (and --dtype, --device, --max-model-len): also what
    a `--config` file's pooling entry is turned into (server/repository/model_config.py)."""
    from stoker.pooling.batcher import BatcherConfig
    from stoker.server.pooling.models import PoolingModelSpec

    batcher = BatcherConfig(
        max_batch_size=args.max_batch_size, preferred_batch_size=tuple(args.preferred_batch_size or ()),
        max_queue_delay_microseconds=args.max_queue_delay_microseconds, priority_levels=args.priority_levels,
        default_priority_level=args.default_priority_level or args.priority_levels, max_queue_size=args.max_queue_size,
        default_timeout_microseconds=args.default_timeout_microseconds,
    )
    return PoolingModelSpec(model_path, names, batcher, args.dtype, args.device, args.max_model_len, args.instance_count)
