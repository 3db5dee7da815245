"""Tool calls out of a model's text, for `tool_choice: "auto"` (`--tool-call-parser NAME`). [no torch]

One module per format, named as vLLM's `--tool-call-parser` names it; each module's docstring
shows what the model writes. The shared contract (base.py): `extract(text) -> Extracted(content,
calls)` for a whole output, and `stream().feed(delta, final)`, which releases a call only once it
is complete, so streamed content and calls put together equal `extract` of the whole text,
however it was chunked. Arguments are always re-serialized as `json.dumps(args,
ensure_ascii=False)`; a call block that does not parse stays in the content as written.

`get_parser(name, tools)` gives the parser for one request: formats that write argument values
as text (qwen3_coder, glm45) type them by the request's tool schemas.
"""

from __future__ import annotations

from stoker.server.generate.tools.parsers.base import Extracted, ToolCall, ToolCallStream, ToolParser, ToolSchemas
from stoker.server.generate.tools.parsers.deepseek_v3 import DeepSeekV3Parser
from stoker.server.generate.tools.parsers.glm45 import Glm45Parser
from stoker.server.generate.tools.parsers.hermes import HermesParser
from stoker.server.generate.tools.parsers.kimi_k2 import KimiK2Parser
from stoker.server.generate.tools.parsers.llama3_json import Llama3JsonParser
from stoker.server.generate.tools.parsers.mistral import MistralParser
from stoker.server.generate.tools.parsers.pythonic import PythonicParser
from stoker.server.generate.tools.parsers.qwen3_coder import Qwen3CoderParser
from stoker.server.generate.tools.parsers.required import RequiredParser
from stoker.server.generate.tools.parsers.openai import HarmonyToolParser

__all__ = ["PARSERS", "REQUIRED", "Extracted", "ToolCall", "ToolCallStream", "ToolParser", "ToolSchemas", "get_parser"]

PARSERS: dict[str, ToolParser] = {p.name: p for p in (
    HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser(), Qwen3CoderParser(), DeepSeekV3Parser(),
    Glm45Parser(), KimiK2Parser(), HarmonyToolParser(),
)}
REQUIRED: ToolParser = RequiredParser()


def get_parser(name: str, tools: ToolSchemas | None = None) -> ToolParser:
    """The parser `--tool-call-parser name` names, for a request with these tools (function
    name -> parameters schema; None: the parser as it is, for checking the name)."""
    try:
        parser = PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}") from None
    return parser.for_request(tools) if tools is not None else parser
