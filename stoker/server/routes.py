"""HTTP routes: parse, hand to the serving classes, answer. No logic lives here."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from stoker.server.errors import ApiError, bad_request
from stoker.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from stoker.server.responses_protocol import ResponsesRequest
from stoker.server.serving import Serving
from stoker.server.serving_chat import OpenAIServingChat
from stoker.server.serving_completion import OpenAIServingCompletion
from stoker.server.serving_responses import OpenAIServingResponses
from stoker.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.stoker


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await OpenAIServingCompletion(_state(request)).create(body, request)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await OpenAIServingChat(_state(request)).create(body, request)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    return await OpenAIServingResponses(_state(request)).create(body, request)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    st = _state(request)
    Serving(st).engine()  # max_model_len is known once the model is loaded
    data = [
        {"id": name, "object": "model", "created": st.created, "owned_by": "stoker", "root": st.settings.model_path,
         "parent": None, "max_model_len": st.max_model_len}
        for name in st.settings.served_model_names
    ]
    return JSONResponse({"object": "list", "data": data})


@router.get("/health")
async def health(request: Request) -> Response:
    """vLLM's meaning: ready for requests. 503 while the model loads, once the engine has died,
    and while shutting down (scripts, Docker health checks and Helm charts poll it before
    sending traffic); liveness is /v1/health/live."""
    Serving(_state(request)).engine()
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
    Serving(st).engine()  # 503 while loading, after a crash, or while shutting down
    return JSONResponse({"object": "health.response", "message": "Service is ready."})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    st = _state(request)
    serving = Serving(st)
    serving.check_model(body.model)
    serving.engine()
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
    serving = Serving(st)
    serving.check_model(body.model)
    serving.engine()
    serving.check_token_ids(body.tokens, "tokens")
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
    Serving(st).engine()  # the tokenizer is loaded with the model
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
