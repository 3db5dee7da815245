"""Which tool-call parser `--tool-call-parser NAME` means: tools/parsers.py's, and gpt-oss's
`openai` (generate/harmony.py), kept in a module of its own. [no torch]"""

from __future__ import annotations

from stoker.server.generate.harmony import HarmonyToolParser
from stoker.server.generate.tools.parsers import PARSERS, ToolParser

EXTRA: dict[str, ToolParser] = {p.name: p for p in (HarmonyToolParser(),)}


def tool_parser_names() -> list[str]:
    return sorted({*PARSERS, *EXTRA})


def get_tool_parser(name: str) -> ToolParser:
    """ValueError naming the known parsers for any other name."""
    parser = EXTRA.get(name) or PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {tool_parser_names()}")
    return parser
