"""Short requests tokenized on the event loop (PoolingModel.encode_inline) give the token ids
the tokenizer thread's transformers call gives, for the BERT WordPiece and the decoder
embedders' tokenizers; long requests and tokenizers that would differ keep the thread."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.engine.tokenizer import load_tokenizer
from stoker.server.pooling.models import INLINE_TOKENIZE_CHARS, PoolingModel, inline_encoder
from stoker.server.pooling.serving import OpenAIServingPooling
from stoker.testing.tiny_pooling import make_bert_embedder, make_decoder_embedder

TEXTS = ["what is the capital of france", "Paris, the capital — naïve café!", "  spaced   out  ", "x", "[SEP] inside",
         "numbers 42 and 3.5", ""]


def model_with(tokenizer) -> PoolingModel:
    return PoolingModel(spec=None, config=None, runner=None, tokenizer=tokenizer, vocab_size=0,  # type: ignore[arg-type]
                        tokenizer_thread=None, worker=None, inline_encoder=inline_encoder(tokenizer))  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [make_bert_embedder, make_decoder_embedder])
@pytest.mark.parametrize("add_special", [True, False])
def test_inline_ids_equal_the_tokenizer_threads(tmp_path: Path, make, add_special: bool) -> None:
    tokenizer = load_tokenizer(make(tmp_path / "m"))
    model = model_with(tokenizer)
    assert model.inline_encoder is not None
    want = OpenAIServingPooling._encode_texts(tokenizer, TEXTS, add_special, None)
    assert model.encode_inline(TEXTS, add_special) == want


def test_long_requests_and_differing_tokenizers_take_the_thread(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(make_bert_embedder(tmp_path / "m"))
    model = model_with(tokenizer)
    assert model.encode_inline(["a" * INLINE_TOKENIZE_CHARS], True) is not None
    assert model.encode_inline(["a" * INLINE_TOKENIZE_CHARS, "b"], True) is None

    class Lowercasing:  # a transformers-side step the Rust tokenizer does not know about
        backend_tokenizer = tokenizer.backend_tokenizer

        def __call__(self, texts, add_special_tokens=True):
            return tokenizer([t.upper() + "!" for t in texts], add_special_tokens=add_special_tokens)

    assert inline_encoder(Lowercasing()) is None
    assert inline_encoder(object()) is None  # a slow tokenizer: no Rust tokenizer at all
