"""HTTP routes: parse, hand to the serving classes, answer. No logic lives here."""

from __future__ import annotations


from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from stoker.server.errors import ApiError, bad_request
from stoker.server.generate.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from stoker.server.generate.responses_protocol import ResponsesRequest
from stoker.server.generate.messages_protocol import CountTokensRequest, MessagesRequest
from stoker.server.generate.serving import Serving
from stoker.server.generate.chat import OpenAIServingChat
from stoker.server.generate.completion import OpenAIServingCompletion
from stoker.server.generate.responses import OpenAIServingResponses
from stoker.server.generate.messages import AnthropicServingMessages
from stoker.server.model_readiness import check_generation, check_ready, pooling_model_cards
from stoker.server.pooling.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from stoker.server.pooling.serving import OpenAIServingPooling
from stoker.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.stoker


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    check_generation(_state(request), "Completions API", body.model)
    return await OpenAIServingCompletion(_state(request)).create(body, request)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    check_generation(_state(request), "Chat Completions API", body.model)
    return await OpenAIServingChat(_state(request)).create(body, request)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    check_generation(_state(request), "Responses API", body.model)
    return await OpenAIServingResponses(_state(request)).create(body, request)


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request) -> Response:
    check_generation(_state(request), "Messages API", body.model)
    return await AnthropicServingMessages(_state(request)).create(body, request)


@router.post("/v1/messages/count_tokens")
async def messages_count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
    check_generation(_state(request), "Messages API", body.model)
    return await AnthropicServingMessages(_state(request)).count_tokens(body)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    st = _state(request)
    check_ready(st)  # max_model_len is known once the model is loaded
    data = [] if not st.serves_generation else [
        {"id": name, "object": "model", "created": st.created, "owned_by": "stoker", "root": st.settings.model_path,
         "parent": None, "max_model_len": st.max_model_len}
        for name in st.settings.served_model_names
    ]
    for name in st.engine.lora_names() if st.engine is not None else []:  # adapters: the base model is their parent
        data.append({"id": name, "object": "model", "created": st.created, "owned_by": "stoker",
                     "root": st.engine.lora_path(name), "parent": st.settings.model_name, "max_model_len": st.max_model_len})
    data += pooling_model_cards(st)
    return JSONResponse({"object": "list", "data": data})


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    return await OpenAIServingPooling(_state(request)).embeddings(body)


@router.post("/v1/rerank")
async def rerank(body: RerankRequest, request: Request) -> JSONResponse:
    return await OpenAIServingPooling(_state(request)).rerank(body)


@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request) -> JSONResponse:
    return await OpenAIServingPooling(_state(request)).score(body)


@router.get("/health")
async def health(request: Request) -> Response:
    """vLLM's meaning: ready for requests. 503 while the model loads, once the engine has died,
    and while shutting down (scripts, Docker health checks and Helm charts poll it before
    sending traffic); liveness is /v1/health/live."""
    check_ready(_state(request))
    return Response(status_code=200)


@router.get("/v1/health/live")
async def live(request: Request) -> JSONResponse:
    """Liveness (NIM's): the process is up and its engine has not died; 200 while loading."""
    st = _state(request)
    if st.load_error is not None or (st.engine is not None and st.engine.is_dead):
        raise ApiError(503, "the engine has stopped; see the server log")
    return JSONResponse({"object": "health.response", "message": "Service is live."})


@router.get("/v1/health/ready")
async def ready(request: Request) -> JSONResponse:
    st = _state(request)
    check_ready(st)  # 503 while loading, after a crash, or while shutting down
    return JSONResponse({"object": "health.response", "message": "Service is ready."})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    st = _state(request)
    st.check_model(body.model)
    st.ready_engine()
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        ids = await st.tokenization.render_chat(body.messages, body.add_generation_prompt)
    else:
        ids = await st.tokenization.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return JSONResponse({"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    st = _state(request)
    st.check_model(body.model)
    st.ready_engine()
    Serving(st).check_token_ids(body.tokens, "tokens")
    return JSONResponse({"prompt": await st.tokenization.decode(body.tokens)})


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> JSONResponse:
    """vLLM's /tokenizer_info: the tokenizer's configuration (tokenizer_config.json as loaded:
    special tokens, model_max_length, added tokens...), `tokenizer_class`, and the chat template
    the server renders with. lm-eval's remote tokenizer reads eos/bos/pad tokens and the
    template from it.

    vLLM serves it only with --enable-tokenizer-info-endpoint, since it shows the template;
    here it is on by default: with --api-key it needs the key, and a client holding the key
    already sees the template at work through /tokenize and the model path in /v1/models.
    --no-enable-tokenizer-info-endpoint turns it off (404, as vLLM without the flag)."""
    st = _state(request)
    if not st.settings.enable_tokenizer_info_endpoint:
        raise ApiError(404, "/tokenizer_info is turned off on this server (--no-enable-tokenizer-info-endpoint)")
    st.ready_engine()  # the tokenizer is loaded with the model
    tok = st.tokenizer
    info = {k: _jsonable(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items()
            if k not in ("vocab_file", "merges_file")}  # file paths on the server, as vLLM drops them
    info["tokenizer_class"] = type(tok).__name__
    if isinstance(getattr(tok, "chat_template", None), str):
        info["chat_template"] = tok.chat_template
    return JSONResponse(info)


def _jsonable(value: Any) -> Any:
    """init_kwargs as JSON: AddedToken objects as their text (as vLLM does), keys as strings,
    anything else not JSON as its str()."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _runtime_lora(request: Request) -> ServerState:
    st = _state(request)
    if not st.settings.allow_runtime_lora_updates:
        raise ApiError(404, "loading and unloading LoRA adapters while serving is off; start the server with "
                            "--allow-runtime-lora-updates (and --enable-lora)")
    if not st.ready_engine().lora_enabled:
        raise bad_request("LoRA is off; start the server with --enable-lora", "lora_name")
    return st


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
    """vLLM's: read, check and register an adapter; requests may name it once this answers."""
    from stoker.lora.adapter import LoRAError

    st = _runtime_lora(request)
    if body.lora_name in st.settings.served_model_names:
        raise bad_request(f"{body.lora_name!r} is the base model's name; give the adapter another", "lora_name")
    try:
        await st.engine.load_lora(body.lora_name, body.lora_path)
    except LoRAError as exc:
        raise bad_request(str(exc), "lora_path" if "already loaded" not in str(exc) else "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
    """vLLM's: new requests may no longer name it; requests already running with it finish."""
    from stoker.lora.adapter import LoRAError

    st = _runtime_lora(request)
    try:
        st.engine.unload_lora(body.lora_name)
    except LoRAError as exc:
        raise ApiError(404, str(exc), "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
