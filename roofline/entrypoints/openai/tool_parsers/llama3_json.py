"""Llama 3.1 / 3.2 JSON tool calls: the whole output is `;`-separated call objects.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}

The output is tool calls only when it starts (after whitespace) with `{` or <|python_tag|>; otherwise it
is all content. "arguments" is accepted for "parameters". Text after the last call is content unless
whitespace only (a trailing `;` is dropped). Malformed (not JSON, no "name", arguments not an object,
<|python_tag|> followed by a built-in tool's Python call): calls before the bad object are kept, the rest is
content, so an output that is not a call at all is content as a whole.
"""

from __future__ import annotations

from typing import Optional

from roofline.entrypoints.openai.tool_parsers.base import (MalformedCall, Pending, ToolCall, ToolParser,
                                                           call_from_object, parse_blocks, raw_decode, skip_ws)

PYTHON_TAG = "<|python_tag|>"


def _parse_block(markup: str, pos: int, final: bool) -> tuple[list[ToolCall], int]:
    if markup.startswith(PYTHON_TAG, pos):
        pos = skip_ws(markup, pos + len(PYTHON_TAG))
    if pos == len(markup):
        raise Pending
    if markup[pos] != "{":
        raise MalformedCall("a call is not a JSON object")
    try:
        obj, end = raw_decode(markup, pos)
    except ValueError:
        if final:
            raise
        raise Pending from None
    return [call_from_object(obj)], end


def _next_block(markup: str, end: int, final: bool) -> tuple[str, Optional[int]]:
    pos = skip_ws(markup, end)
    if pos < len(markup) and markup[pos] == ";":
        nxt = skip_ws(markup, pos + 1)
        if nxt < len(markup):
            return "", nxt
    if not final:
        raise Pending
    return ("" if pos < len(markup) and markup[pos] == ";" else markup[end:]), None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = ("{", PYTHON_TAG)
    markup_at_start_only = True

    def _parse_markup(self, markup: str, final: bool) -> tuple[list[ToolCall], str]:
        return parse_blocks(markup, final, _parse_block, _next_block)
