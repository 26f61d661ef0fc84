"""Mistral tool calls: after [TOOL_CALLS], a JSON array of calls or (v11+ tokenizers) `name[ARGS]{...}`.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}

[TOOL_CALLS] must be in the text (the server must not skip special tokens). In the v11+ form a
`[CALL_ID]id` after the name is accepted and dropped, and [ARGS] may be missing (`name{...}`); a lone
call object (`[TOOL_CALLS]{"name": ..., "arguments": ...}`) is accepted too. Each
[TOOL_CALLS] block is all-or-nothing: an array with one bad element is content as a whole. Malformed: see
`base` (calls before the first bad block are kept, the rest is content).
"""

from __future__ import annotations

import re

from roofline.entrypoints.openai.tool_parsers.base import (MalformedCall, Pending, ToolCall, ToolParser,
                                                           call_from_object, dump_arguments, is_partial,
                                                           next_at_marker, parse_blocks, raw_decode, skip_ws)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[\w.\-]+")
_ID = re.compile(r"[\w\-]+")


def _decode(markup: str, pos: int, final: bool):
    """The JSON value at pos and the offset after it; Pending when it may still be cut (not final)."""
    if pos >= len(markup):
        raise Pending
    try:
        return raw_decode(markup, pos)
    except ValueError:
        if final:
            raise
        raise Pending from None


def _parse_array(markup: str, pos: int, final: bool) -> tuple[list[ToolCall], int]:
    calls: list[ToolCall] = []
    pos = skip_ws(markup, pos + 1)
    while True:
        if pos >= len(markup):
            raise Pending
        if markup[pos] == "]":
            return calls, pos + 1
        if calls:
            if markup[pos] != ",":
                raise MalformedCall("expected , or ] in the call array")
            pos = skip_ws(markup, pos + 1)
        obj, pos = _decode(markup, pos, final)
        calls.append(call_from_object(obj))
        pos = skip_ws(markup, pos)


def _parse_named(markup: str, pos: int, final: bool) -> tuple[list[ToolCall], int]:
    m = _NAME.match(markup, pos)
    if m is None or m.end() == len(markup):
        raise Pending if m is not None or pos == len(markup) else MalformedCall("no function name")
    name, pos = m.group(), skip_ws(markup, m.end())
    if markup.startswith(CALL_ID, pos):
        m = _ID.match(markup, skip_ws(markup, pos + len(CALL_ID)))
        if m is None or m.end() == len(markup):
            raise Pending
        pos = skip_ws(markup, m.end())
    if markup.startswith(ARGS, pos):
        pos = skip_ws(markup, pos + len(ARGS))
    elif pos == len(markup) or is_partial(markup, pos, ARGS) or is_partial(markup, pos, CALL_ID):
        raise Pending
    if pos < len(markup) and markup[pos] != "{":
        raise MalformedCall("expected the arguments object")
    args, end = _decode(markup, pos, final)
    return [ToolCall(name, dump_arguments(args))], end


def _parse_block(markup: str, pos: int, final: bool) -> tuple[list[ToolCall], int]:
    pos = skip_ws(markup, pos + len(TOOL_CALLS))
    if pos == len(markup):
        raise Pending
    if markup[pos] == "[" and not markup.startswith((ARGS, CALL_ID), pos):
        return _parse_array(markup, pos, final)
    if markup[pos] == "{":  # a lone call object
        obj, end = _decode(markup, pos, final)
        return [call_from_object(obj)], end
    return _parse_named(markup, pos, final)


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = (TOOL_CALLS,)

    def _parse_markup(self, markup: str, final: bool) -> tuple[list[ToolCall], str]:
        return parse_blocks(markup, final, _parse_block, next_at_marker((TOOL_CALLS,)))
