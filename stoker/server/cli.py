"""`stoker serve [MODEL_DIR] [engine flags] [server flags]`.

Registration stays light (argparse only); FastAPI, uvicorn and torch load inside `run`.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
from pathlib import Path
from typing import Any

from stoker.engine.args import add_engine_args, engine_kwargs
from stoker.server.pooling.cli import add_pooling_args, pooling_models_from_args
from stoker.server.generate.reasoning import PARSERS as REASONING_PARSERS
from stoker.server.generate.tools.parsers import PARSERS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI- and vLLM-compatible HTTP server (completions, chat, responses, embeddings, rerank, score, metrics)",
        description="Serve a Hugging Face checkpoint over the OpenAI API (as vLLM and NIM serve it). "
        "With no MODEL_DIR, a small random-weight demo model is made and served.",
    )
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                   help="checkpoint folder (config.json + *.safetensors + tokenizer) or a .gguf file; default: the "
                        "built-in demo model")
    add_engine_args(p, model_required=False)
    s = p.add_argument_group("server")
    s.add_argument("--config", default=None, metavar="models.yaml|REPOSITORY",
                   help="serve several models: at most one generative and any number of embedding / reranker models, "
                        "each with its own settings, from a YAML file or a model repository folder (one subfolder "
                        "per model; docs/server.md, \"Several models in one server\"); replaces MODEL_DIR and the "
                        "per-model flags")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients send in `model` (default: MODEL_DIR as given, or stoker-demo)")
    s.add_argument("--api-key", default=os.environ.get("STOKER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on the API (default: $STOKER_API_KEY; unset: open)")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 + Retry-After when this many admitted sequences (n per prompt) have no output yet "
                        "(default: no limit)")
    s.add_argument("--header-read-timeout", type=float, default=10.0,
                   help="seconds a request's headers may take to arrive; slower: 408 and the connection closed (default 10)")
    s.add_argument("--body-read-timeout", type=float, default=30.0,
                   help="seconds the server waits for each next piece of a request body; longer: 408 (default 30)")
    s.add_argument("--max-request-body-bytes", type=int, default=16 * 2**20, help="larger bodies get 413 (default 16 MiB)")
    s.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs / top_logprobs a request may ask")
    s.add_argument("--enable-tokenizer-info-endpoint", action=argparse.BooleanOptionalAction, default=True,
                   help="serve GET /tokenizer_info (tokenizer config and chat template; vLLM's flag, on by default "
                        "here: with --api-key it needs the key)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let requests use tool_choice 'auto' (the default when tools are sent): the model's text is "
                        "parsed for tool calls by --tool-call-parser (as vLLM)")
    s.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="the format the model writes tool calls in (vLLM's names): hermes (Hermes, Qwen 2.5/3: "
                        "<tool_call>{...}</tool_call>), llama3_json (Llama 3.x: {\"name\": ..., \"parameters\": ...}), "
                        "mistral ([TOOL_CALLS]...), pythonic (Llama 3.2/4: [f(a=1)]), qwen3_coder (<function=f>"
                        "<parameter=a>...), deepseek_v3 (DeepSeek V3/V3.1), glm45 (GLM-4.5/4.6: <arg_key>...), "
                        "kimi_k2 (Kimi K2), openai (gpt-oss harmony); docs/server.md shows each")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="run a chat_template sent in a request (vLLM's flag; off: such requests are refused, "
                        "a template is code the server runs)")
    s.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a reasoning model's thinking out of its text into reasoning_content / reasoning (as vLLM): "
                        "deepseek_r1 and qwen3 (<think>...</think>), granite, gpt_oss (harmony)")
    s.add_argument("--roofline-profile", default=None, metavar="kernel|engine|FILE",
                   help="efficiencies the live wall verdict in /metrics predicts steps with (default: engine on a GPU; "
                        "on a CPU the roofs `stoker doctor --write-device-file` measured)")
    s.add_argument("--enable-request-timing", action="store_true",
                   help="add stoker_timing to each response (the final chunk when streamed): queue, prefill and decode "
                        "seconds, engine steps taken and the wall they ran against")
    s.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters to serve (with --enable-lora): NAME=PATH or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ...}'; a request's model NAME uses the adapter")
    s.add_argument("--allow-runtime-lora-updates", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter while serving (vLLM: "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    s.add_argument("--log-interval", type=float, default=10.0, help="seconds between engine log lines (only when busy)")
    s.add_argument("--shutdown-timeout", type=float, default=None,
                   help="on SIGTERM, seconds to let in-flight requests finish before closing them (default: wait)")
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no per-request access log line")
    s.add_argument("--headless", action="store_true",
                   help="run only this node's tensor-parallel ranks, no server (nodes other than 0 of --nnodes)")
    s.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_pooling_args(p)
    p.set_defaults(func=run, parser=p)


def _llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags `LLM(...)` takes; a flag it does not know must still be at its default."""
    from stoker.engine.llm import LLM

    kwargs = engine_kwargs(args)
    accepted = inspect.signature(LLM.__init__).parameters
    defaults = {"tensor_parallel_size": 1, "kv_cache_dtype": "auto", "quantization": None, "activation_dtype": "auto"}
    for name in list(kwargs):
        if name not in accepted:
            value = kwargs.pop(name)
            if value != defaults.get(name, value):
                raise ValueError(f"--{name.replace('_', '-')} {value} is not supported by this engine yet")
    return kwargs


# What a headless node honours; every other setting comes from rank 0.
_HEADLESS_FLAGS = {"model_dir", "tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port",
                   "distributed_timeout", "device", "headless", "func", "parser"}


def _run_headless(args: argparse.Namespace) -> int:
    from stoker.config import ParallelConfig
    from stoker.executor.headless import run_node

    if args.headless:  # under torchrun every rank runs the same command: rank 0 honours the rest
        defaults = vars(args.parser.parse_args([]))
        ignored = sorted(k for k, v in vars(args).items() if k in defaults and k not in _HEADLESS_FLAGS and v != defaults[k])
        if ignored:
            names = ", ".join("--" + k.replace("_", "-") for k in ignored)
            raise ValueError(f"{names}: a --headless node takes every engine and server setting from node 0; "
                             "pass these to node 0's `stoker serve` instead")

    pc = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes, node_rank=args.node_rank,
                        master_addr=args.master_addr, master_port=args.master_port,
                        distributed_timeout_s=args.distributed_timeout)
    return run_node(pc, args.device, args.model_dir)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.headless or os.environ.get("RANK", "0") not in ("", "0"):
        return _run_headless(args)  # torchrun / Kubernetes: a rank > 0 serves the group, not HTTP
    import uvicorn

    from stoker.server.http.limits import header_timeout_protocol

    fatal: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        if server is not None:
            server.should_exit = True

    app, settings = build_app(args, on_fatal)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log, timeout_graceful_shutdown=args.shutdown_timeout,
        http=header_timeout_protocol(settings.header_read_timeout_s),
    )
    server = uvicorn.Server(config)
    server.run()
    if fatal:
        print(f"stoker serve: error: {fatal[0]}", file=sys.stderr)
        return 1
    return 0


def build_app(args: argparse.Namespace, on_fatal: Any = None) -> tuple[Any, Any]:
    """The app `stoker serve` runs for these flags (MODEL_DIR, the demo model, or --config) and its settings."""
    from stoker.engine.llm import LLM
    from stoker.server.app import create_app
    from stoker.server.demo_model import DEMO_NAME, RANDOM_WEIGHTS_NOTICE, demo_model_dir
    from stoker.server.state import ServerSettings

    models_config = None
    if args.config is not None:
        from stoker.server.repository.model_config import load_serve_config, refuse_flags_with_config

        refuse_flags_with_config(args, args.parser)
        models_config = load_serve_config(args.config)
        first = models_config.generate or models_config.pooling[0]
        model_path, default_name = first.path, first.names[0]
        names = first.names
        gen = models_config.generate
        kwargs = _llm_kwargs(gen.args) if gen else {}
        enable_lora = gen.args.enable_lora if gen else False
    elif args.model_dir is None:
        print("stoker serve: preparing the demo model (first run only; a few seconds)...", file=sys.stderr, flush=True)
        model_path = str(demo_model_dir())
        print(RANDOM_WEIGHTS_NOTICE.format(name=DEMO_NAME, path=model_path), file=sys.stderr, flush=True)
        default_name = DEMO_NAME
    else:
        model_path = args.model_dir
        if model_path.lower().endswith(".gguf"):  # a llama.cpp file (models/gguf_loader.py)
            if not Path(model_path).is_file():
                raise FileNotFoundError(f"{model_path}: no such GGUF file")
        elif not (Path(model_path) / "config.json").is_file():
            raise FileNotFoundError(f"{model_path}: no config.json; MODEL_DIR must be a Hugging Face checkpoint folder "
                                    "or a .gguf file")
        default_name = model_path
    if models_config is None:
        kwargs = _llm_kwargs(args)
        names, enable_lora = tuple(args.served_model_name or [default_name]), args.enable_lora
    settings = ServerSettings(
        model_path=model_path,
        served_model_names=names,
        api_key=args.api_key or None,
        max_waiting_requests=args.max_waiting_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        max_logprobs=args.max_logprobs,
        log_interval_s=args.log_interval,
        body_read_timeout_s=args.body_read_timeout,
        header_read_timeout_s=args.header_read_timeout,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        trust_request_chat_template=args.trust_request_chat_template,
        reasoning_parser=args.reasoning_parser,
        roofline_profile=args.roofline_profile,
        enable_request_timing=args.enable_request_timing,
        lora_modules=parse_lora_modules(args.lora_modules, enable_lora),
        allow_runtime_lora_updates=args.allow_runtime_lora_updates,
    )
    if models_config is not None:
        from stoker.server.pooling.models import PoolingModels

        pooling = PoolingModels(models_config.pooling) if models_config.pooling else None
        generative = models_config.generate is not None
    else:
        pooling = pooling_models_from_args(args, model_path, settings.served_model_names)  # an embedding / reranker folder
        generative = pooling is None
    app = create_app(settings, (lambda: LLM(model_path, **kwargs).engine) if generative else None, on_fatal=on_fatal,
                     drain_timeout_s=args.shutdown_timeout, pooling=pooling)
    return app, settings


def parse_lora_modules(items: list[str], enabled: bool) -> tuple[tuple[str, str], ...]:
    """--lora-modules NAME=PATH or '{"name": ..., "path": ...}' -> ((name, path), ...)."""
    import json

    out: list[tuple[str, str]] = []
    for item in items:
        if item.lstrip().startswith("{"):
            d = json.loads(item)
            name, path = d.get("name"), d.get("path")
        else:
            name, _, path = item.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules {item!r}: give NAME=PATH (or {{\"name\": ..., \"path\": ...}})")
        out.append((name, path))
    if out and not enabled:
        raise ValueError("--lora-modules needs --enable-lora")
    return tuple(out)
