"""DeepSeek V3 / R1 / V3.1 tool calls, between full-width-bar special tokens.

    V3, R1:  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
             ```json
             {"city": "Paris"}
             ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1:    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>...

(｜ is U+FF5C, ▁ is U+2581.) Markup starts at <｜tool▁calls▁begin｜> or at a bare <｜tool▁call▁begin｜>; the
two forms are told apart by what follows the separator (a JSON object: V3.1). The code fence is optional.
A call missing its <｜tool▁call▁end｜> ends at the next call or at the end of the output and counts when its
JSON parses. The calls-begin/end tokens between calls are dropped. Malformed: see `base` (calls before the
first bad call are kept, the rest is content).
"""

from __future__ import annotations

from typing import Optional

from roofline.entrypoints.openai.tool_parsers.base import (MalformedCall, Pending, ToolCall, ToolParser,
                                                           dump_arguments, first_marker, is_partial, loads,
                                                           parse_blocks, skip_ws)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _parse_call(inner: str) -> ToolCall:
    head, sep, body = inner.partition(SEP)
    if not sep:
        raise MalformedCall("no tool separator")
    body = body.strip()
    if body.startswith("{"):  # V3.1: NAME<sep>{...}
        name = head.strip()
    else:  # V3: TYPE<sep>NAME\n```json\n{...}\n```
        name, _, body = body.partition("\n")
        name, body = name.strip(), body.strip()
        if body.startswith("```"):
            body = body[3:]
            if body.startswith("json"):
                body = body[4:]
            if body.rstrip().endswith("```"):
                body = body.rstrip()[:-3]
    if not name:
        raise MalformedCall("a call has no name")
    return ToolCall(name, dump_arguments(loads(body)))


def _parse_block(markup: str, pos: int, final: bool) -> tuple[list[ToolCall], int]:
    if markup.startswith(CALLS_BEGIN, pos):
        pos = skip_ws(markup, pos + len(CALLS_BEGIN))
    if not markup.startswith(CALL_BEGIN, pos):
        raise Pending if pos == len(markup) or is_partial(markup, pos, CALL_BEGIN) else MalformedCall(
            "expected a tool call")
    body = pos + len(CALL_BEGIN)
    found = first_marker(markup, body, (CALL_END, CALL_BEGIN, CALLS_END), final)
    if found is None:
        return [_parse_call(markup[body:])], len(markup)
    end = found[0] + (len(CALL_END) if found[1] == CALL_END else 0)
    return [_parse_call(markup[body:found[0]])], end


def _next_block(markup: str, end: int, final: bool) -> tuple[str, Optional[int]]:
    found = first_marker(markup, end, (CALL_BEGIN,), final)
    between = markup[end:] if found is None else markup[end:found[0]]
    return between.replace(CALLS_END, "").replace(CALLS_BEGIN, ""), None if found is None else found[0]


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    start_markers = (CALLS_BEGIN, CALL_BEGIN)

    def _parse_markup(self, markup: str, final: bool) -> tuple[list[ToolCall], str]:
        return parse_blocks(markup, final, _parse_block, _next_block)
