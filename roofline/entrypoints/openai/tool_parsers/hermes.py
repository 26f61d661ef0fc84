"""Hermes-style tool calls (Hermes 2/3, Qwen2.5, Qwen3, SmolLM3): one JSON object per <tool_call> block.

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

"parameters" is accepted for "arguments". A block missing its </tool_call> ends at the next <tool_call> or
at the end of the output, and counts when its JSON parses. Malformed: see `base` (calls before the first
bad block are kept, the rest is content).
"""

from __future__ import annotations

from roofline.entrypoints.openai.tool_parsers.base import (ToolCall, ToolParser, call_from_object,
                                                           first_marker, loads, next_at_marker, parse_blocks)

START, END = "<tool_call>", "</tool_call>"


def _parse_block(markup: str, pos: int, final: bool) -> tuple[list[ToolCall], int]:
    body = pos + len(START)
    found = first_marker(markup, body, (END, START), final)
    if found is None:
        inner, end = markup[body:], len(markup)
    else:
        inner, end = markup[body:found[0]], found[0] + (len(END) if found[1] == END else 0)
    return [call_from_object(loads(inner))], end


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = (START,)

    def _parse_markup(self, markup: str, final: bool) -> tuple[list[ToolCall], str]:
        return parse_blocks(markup, final, _parse_block, next_at_marker((START,)))
