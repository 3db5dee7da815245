"""What one server process holds: settings, the engine once loaded, its tokenizer, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from stoker.engine.async_engine import AsyncEngine
from stoker.server.errors import ApiError
from stoker.server.observe.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerSettings:
    model_path: str
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_request_body_bytes: int = 16 * 2**20
    body_read_timeout_s: float = 30.0  # longest wait for the next piece of a request body (408 after)
    header_read_timeout_s: float = 10.0  # a request's headers must arrive within this (408 after; http/limits.py)
    max_logprobs: int = 20
    log_interval_s: float = 10.0
    retry_after_s: int = 1
    warmup: bool = True
    # GET /tokenizer_info (vLLM's flag name; vLLM's default is off, ours on: see routes.py)
    enable_tokenizer_info_endpoint: bool = True
    # tool_choice "auto": the model's text is parsed for tool calls by this parser (generate/tools/parsers/)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    trust_request_chat_template: bool = False  # a request's own chat_template is run (else a 400)
    # chat: the model's thinking split out of its text by this parser (generate/reasoning.py)
    reasoning_parser: str | None = None
    # The efficiency profile the live wall verdict predicts steps with (roofline/profiles.py:
    # kernel, engine or a file); None: "engine" on a GPU, the measured roofs on a CPU (engine/wall_model.py).
    roofline_profile: str | None = None
    # Per request: queue, prefill and decode time, steps and their wall, as `stoker_timing` in
    # the response (the final chunk when streamed). Off by default, as it adds a field.
    enable_request_timing: bool = False
    # LoRA adapters to load at start-up (name, PEFT folder); runtime (un)loading through the API
    lora_modules: tuple[tuple[str, str], ...] = ()
    allow_runtime_lora_updates: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        for name in ("body_read_timeout_s", "header_read_timeout_s"):
            if not getattr(self, name) > 0:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"{flag} must be > 0 seconds, got {getattr(self, name)}")
        if self.tool_call_parser is not None:
            from stoker.server.generate.tools.parsers import get_parser

            get_parser(self.tool_call_parser)  # ValueError naming the known parsers
        if self.reasoning_parser is not None:
            from stoker.server.generate.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)  # ValueError naming the known parsers
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes calls in)")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


@dataclass
class ServerState:
    """The registry of what the server serves: the generative model (its served names, its LoRA
    adapters, the engine) and the pooling models; every wing asks it which model a request names."""

    settings: ServerSettings
    engine: AsyncEngine | None = None
    # The server's own tokenizer: the engine thread uses the engine's, and HF fast
    # tokenizers are not meant to be shared across threads.
    tokenizer: Any = None
    # Prompt encoding, chat templating and /detokenize, on a worker thread of their own
    # with a second tokenizer instance (server/generate/tokenization.py).
    tokenization: Any = None
    max_model_len: int = 0
    max_num_seqs: int = 0  # the engine's batch limit: also the most sequences one request may ask
    vocab_size: int = 0
    ready: bool = False
    load_error: BaseException | None = None
    # Embedding / reranker models (server/pooling/models.py: PoolingModels), None when the server
    # holds none; serves_generation is False for a server of pooling models only.
    pooling: Any = None
    serves_generation: bool = True
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.settings.model_name, lambda: self.engine)
        if self.settings.enable_request_timing:
            self.metrics.wall.track_requests()

    # ------------------------------------------------------------------ served models
    def check_model(self, model: str | None) -> str:
        """The model name the request asked for: a served name of the base model, or (with
        --enable-lora) a loaded adapter's name; anything else is a 404 in OpenAI's shape."""
        names = self.settings.served_model_names
        if model is not None and model not in names and self.lora_name(model) is None:
            served = list(names) + self.adapter_names()
            raise ApiError(404, f"The model `{model}` does not exist. Served: {', '.join(served)}", "model")
        return model or names[0]

    def lora_name(self, model: str | None) -> str | None:
        """The adapter a request's `model` names, or None for the base model."""
        if model is None or model in self.settings.served_model_names or self.engine is None:
            return None
        return model if self.engine.has_lora(model) else None

    def adapter_names(self) -> list[str]:
        return self.engine.lora_names() if self.engine is not None else []

    def ready_engine(self) -> AsyncEngine:
        """The engine, or a 503 while the model loads and once the engine has died."""
        if self.engine is not None and self.engine.is_dead:
            raise ApiError(503, "the engine has stopped after an internal error; restart the server")
        if not self.ready or self.engine is None:
            raise ApiError(503, "the model is still loading; retry when /v1/health/ready answers 200",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        return self.engine
