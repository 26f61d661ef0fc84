"""Qwen3-Coder tool calls: XML-like function blocks whose parameter values are raw text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A bare <function=...> block (no <tool_call>) is accepted, and so is a parameter missing its </parameter>
(it ends at the next <parameter= or at </function>). A value loses one leading and one trailing newline;
it becomes a JSON number, true/false/null, object or array when it parses as one, else stays a string
(there is no tool schema here to say what was meant). A call counts only with its </function>, so a cut
output never yields a call with a truncated value. Malformed: see `base` (calls before the first bad block
are kept, the rest is content).
"""

from __future__ import annotations

import json
from typing import Any

from roofline.entrypoints.openai.tool_parsers.base import (MalformedCall, Pending, ToolCall, ToolParser,
                                                           dump_arguments, first_marker, is_partial, loads,
                                                           next_at_marker, parse_blocks, skip_ws)

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def convert(value: str) -> Any:
    """A parameter's text -> its JSON value (see the module docstring)."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    try:
        parsed = loads(value)
        json.dumps(parsed, allow_nan=False)
    except (ValueError, RecursionError):
        return value
    return value if isinstance(parsed, str) else parsed


def _tag_name(markup: str, pos: int) -> tuple[str, int]:
    """The name in `<tag=NAME>` whose NAME starts at pos, and the offset after `>`."""
    close = markup.find(">", pos)
    if close < 0:
        if "\n" in markup[pos:] or "<" in markup[pos:]:
            raise MalformedCall("unclosed tag")
        raise Pending
    name = markup[pos:close].strip()
    if not name or "\n" in name or "<" in name:
        raise MalformedCall("bad tag name")
    return name, close + 1


def _parse_block(markup: str, pos: int, final: bool) -> tuple[list[ToolCall], int]:
    if markup.startswith(TOOL_CALL, pos):
        pos = skip_ws(markup, pos + len(TOOL_CALL))
    if not markup.startswith(FUNCTION, pos):
        raise Pending if pos == len(markup) or is_partial(markup, pos, FUNCTION) else MalformedCall(
            "expected <function=")
    name, pos = _tag_name(markup, pos + len(FUNCTION))
    args: dict[str, Any] = {}
    while True:
        pos = skip_ws(markup, pos)
        if markup.startswith(FUNCTION_END, pos):
            pos += len(FUNCTION_END)
            break
        if markup.startswith(PARAMETER, pos):
            param, pos = _tag_name(markup, pos + len(PARAMETER))
            found = first_marker(markup, pos, (PARAMETER_END, PARAMETER, FUNCTION_END), final)
            if found is None:
                raise Pending
            args[param] = convert(markup[pos:found[0]])
            pos = found[0] + (len(PARAMETER_END) if found[1] == PARAMETER_END else 0)
            continue
        if pos == len(markup) or is_partial(markup, pos, FUNCTION_END) or is_partial(markup, pos, PARAMETER):
            raise Pending
        raise MalformedCall("expected <parameter= or </function>")
    after = skip_ws(markup, pos)
    return [ToolCall(name, dump_arguments(args))], (
        after + len(TOOL_CALL_END) if markup.startswith(TOOL_CALL_END, after) else pos)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    start_markers = (TOOL_CALL, FUNCTION)

    def _parse_markup(self, markup: str, final: bool) -> tuple[list[ToolCall], str]:
        return parse_blocks(markup, final, _parse_block, next_at_marker((TOOL_CALL, FUNCTION)))
