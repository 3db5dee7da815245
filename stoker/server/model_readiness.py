"""Readiness and model cards over what a server holds: the generative engine, pooling models, or both."""

from __future__ import annotations

from typing import Any

from stoker.server.errors import bad_request
from stoker.server.state import ServerState


def check_ready(st: ServerState) -> None:
    """503 (ApiError) until every model the server holds is loaded; also after a crash or at shutdown."""
    if st.serves_generation:
        st.ready_engine()
    if st.pooling is not None:
        st.pooling.get(None, st.settings.retry_after_s)


def check_generation(st: ServerState, api: str, model: str | None = None) -> None:
    """vLLM's answer to a generation request on a server of pooling models, or (a server holding
    both) to one whose `model` names a pooling model: a 400 naming `model`."""
    if not st.serves_generation:
        raise bad_request(f"The model does not support {api}: this server holds only embedding / reranker models "
                          "(/v1/embeddings, /v1/rerank, /v1/score)", "model")
    if model is not None and st.pooling is not None and model in st.pooling.names:
        raise bad_request(f"The model `{model}` does not support {api}: it is an embedding / reranker model "
                          "(/v1/embeddings, /v1/rerank, /v1/score)", "model")


def pooling_model_cards(st: ServerState) -> list[dict[str, Any]]:
    if st.pooling is None:
        return []
    return [{"id": name, "object": "model", "created": st.created, "owned_by": "stoker", "root": m.spec.path,
             "parent": None, "max_model_len": m.config.max_model_len}
            for m in st.pooling.models for name in m.names]
