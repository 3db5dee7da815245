"""The array `tool_choice: "required"` constrains the output to (not a `--tool-call-parser`). [no torch]

    [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]

Whatever does not complete a call (an output cut by max_tokens) is content.
"""

from __future__ import annotations

from stoker.server.generate.tools.parsers.base import Extracted, ParserBase, ToolCallStream
from stoker.server.generate.tools.parsers.llama3_json import json_call_at, skip_separators


class RequiredParser(ParserBase):
    name = "required"

    def extract(self, text: str) -> Extracted:
        stream = _RequiredStream()
        return stream.feed(text, final=True)

    def stream(self) -> ToolCallStream:
        return _RequiredStream()


class _RequiredStream:
    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # text[:pos] is parsed
        self.opened = False
        self.done = False

    def feed(self, delta: str, final: bool = False) -> Extracted:
        self.text += delta
        text, calls = self.text, []
        while not self.done:
            i = skip_separators(text, self.pos)
            if not self.opened:
                if i < len(text) and text[i] == "[":
                    self.opened, self.pos = True, i + 1
                    continue
                break
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            if i < len(text) and text[i] == "]":
                self.done, self.pos = True, i + 1
                break
            got = json_call_at(text, i) if i < len(text) and text[i] == "{" and "}" in text[i:] else None
            if got is None or got[0] is None:
                break
            calls.append(got[0])
            self.pos = got[1]
        content = ""
        if final:
            content, self.pos = text[self.pos:].lstrip(" \t\r\n,").rstrip(), len(text)
        return Extracted((content or None) if final else "", calls)
