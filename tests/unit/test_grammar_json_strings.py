"""JSON strings under a grammar never hold a raw control character (stoker/structured/grammar.py).

xgrammar's bounded-length string rule admits U+0000-U+001F; the cache narrows it. A JSON parser
that follows the spec (pydantic's strict mode, Python's json with strict=True) refuses such text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

xgr = pytest.importorskip("xgrammar")
from transformers import PreTrainedTokenizerFast  # noqa: E402

from stoker.structured.grammar import _BOUNDED_STRING_CHAR, GrammarCache  # noqa: E402
from stoker.structured.spec import StructuredOutputs  # noqa: E402

TOKENIZER = Path(__file__).resolve().parents[2] / "stoker" / "assets" / "demo_tokenizer"
SCHEMA = {"type": "object", "properties": {"short": {"type": "string", "maxLength": 8},
                                           "long": {"type": "string", "minLength": 1},
                                           "free": {"type": "string"}},
          "required": ["short", "long", "free"], "additionalProperties": False}


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    tok = PreTrainedTokenizerFast.from_pretrained(TOKENIZER)
    return GrammarCache(tok, len(tok), (tok.eos_token_id,))


def _accepts(grammar: object, text: str) -> bool:
    return bool(xgr.testing._is_grammar_accept_string(grammar, text))


def test_xgrammar_still_writes_the_rule_that_is_patched() -> None:
    """If xgrammar's EBNF changes, the patch would silently do nothing: this fails first."""
    raw = str(xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False, strict_mode=True))
    assert _BOUNDED_STRING_CHAR in raw
    assert _accepts(xgr.Grammar.from_ebnf(raw), '{"short": "a\x08b", "long": "x", "free": "y"}')  # the upstream bug


@pytest.mark.parametrize("field", ["short", "long", "free"])
@pytest.mark.parametrize("char", ["\x00", "\x08", "\x1f", "\t"])
def test_no_raw_control_character_in_any_string(cache: GrammarCache, field: str, char: str) -> None:
    grammar = cache._json_grammar(json.dumps(SCHEMA), strict_mode=True)
    values = {"short": "ab", "long": "xy", "free": "z"}
    good = json.dumps(values, separators=(", ", ": "))
    assert _accepts(grammar, good)
    bad = good.replace(f'"{values[field]}"', f'"a{char}b"')  # raw, as json.dumps never writes it
    assert bad != good and not _accepts(grammar, bad)
    if field == "free":  # escaped, it is fine (xgrammar's bounded strings take no escapes at all)
        assert _accepts(grammar, good.replace(f'"{values[field]}"', '"a\\u0008b"'))
    with pytest.raises(json.JSONDecodeError):
        json.loads(bad, strict=True)  # what the grammar now refuses is what strict JSON refuses


def test_compiled_json_specs_use_the_patched_grammar(cache: GrammarCache) -> None:
    compiled = cache.compile(StructuredOutputs.from_schema(SCHEMA))
    matcher = xgr.GrammarMatcher(compiled)
    tok = PreTrainedTokenizerFast.from_pretrained(TOKENIZER)
    ids = tok.encode('{"short": "a\x08', add_special_tokens=False)
    assert not all(matcher.accept_token(t) for t in ids)
