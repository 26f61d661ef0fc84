"""What a tool-call parser returns, and the base class that streams any format from one parse routine.

A format module implements `_parse_markup(markup, final)`: the tool calls in `markup` (the text from the
first tool-call start marker on) and, when `final`, the content left in it. The base class finds where
markup starts, streams the content before it as it comes (holding back a trailing partial start marker,
and any content while it is whitespace only), re-parses the markup after each piece and sends each call
once its markup is complete, and at `finish()` parses the whole text and sends what is left. Streamed
and non-streamed results are therefore the same for any split of the text.

Results, in every format:
- `content` is the text that is not tool-call markup: the text before the first call, then any text
  between or after calls that is not whitespace only, then, from the first point where the markup breaks
  (bad JSON, a missing name, an unclosed block that does not parse), the rest of the text verbatim. The
  calls before that point are kept. Content that is empty or whitespace only is None.
- `arguments` is `json.dumps(obj, ensure_ascii=False)` of the parsed arguments object; NaN and infinities
  are rejected (the call is then malformed), control characters inside JSON strings are accepted.
- Streaming sends one `ToolCallDelta` per call carrying both its name and its complete arguments.
- Nothing raises on model output.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

logger = logging.getLogger(__name__)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ExtractedToolCalls:
    content: Optional[str]  # the text that is not tool-call markup; None when empty or whitespace only
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    index: int  # which call (0, 1, ...)
    name: Optional[str] = None  # on the first delta of a call only
    arguments: Optional[str] = None  # a fragment of the arguments JSON text


@dataclass
class DeltaResult:
    content: Optional[str] = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class MalformedCall(ValueError):
    """A block of tool-call markup that is complete but is not a valid call."""


class Pending(Exception):
    """The markup so far is cut inside a block: wait for more text (a malformed block when final)."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, strict=False)


def loads(text: str) -> Any:
    """JSON text -> value; surrounding whitespace allowed, NaN/Infinity rejected (ValueError)."""
    return _DECODER.decode(text)


def raw_decode(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value starting at text[pos] (no leading whitespace) and the offset after it (ValueError)."""
    return _DECODER.raw_decode(text, pos)


def dump_arguments(args: Any) -> str:
    """The arguments JSON text of a call: `args` must be a dict (MalformedCall otherwise)."""
    if not isinstance(args, dict):
        raise MalformedCall(f"arguments are a {type(args).__name__}, not an object")
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise MalformedCall(str(e)) from None


def call_from_object(obj: Any) -> ToolCall:
    """A call from a parsed `{"name": ..., "arguments" | "parameters": {...}}` object (MalformedCall).

    Arguments given as a JSON string holding an object are accepted; missing or null arguments are `{}`.
    """
    if not isinstance(obj, dict):
        raise MalformedCall("a call is not a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise MalformedCall("a call has no name")
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None:
        args = {}
    elif isinstance(args, str):
        try:
            args = loads(args) if args.strip() else {}
        except ValueError:
            raise MalformedCall("arguments string is not JSON") from None
    return ToolCall(name.strip(), dump_arguments(args))


def skip_ws(text: str, pos: int) -> int:
    """The offset of the first non-whitespace character at or after pos (len(text) if none)."""
    n = len(text)
    while pos < n and text[pos].isspace():
        pos += 1
    return pos


def is_partial(text: str, pos: int, marker: str) -> bool:
    """Whether text[pos:] is a proper prefix of marker (the marker may still arrive)."""
    rest = text[pos:]
    return len(rest) < len(marker) and marker.startswith(rest)


def partial_start(text: str, start: int, markers: tuple[str, ...]) -> int:
    """The earliest offset >= start from which the end of text is a proper prefix of a marker (else len)."""
    best = len(text)
    for m in markers:
        for size in range(min(len(m) - 1, len(text) - start), 0, -1):
            if text.endswith(m[:size]):
                best = min(best, len(text) - size)
                break
    return best


def first_marker(text: str, start: int, markers: tuple[str, ...], final: bool) -> Optional[tuple[int, str]]:
    """The earliest complete marker at or after start: (offset, marker), or None when there is none.

    With final=False the answer must hold for any longer text: raises Pending when no marker is found yet
    or when one may still begin earlier (a partial marker at the end of text starts before it).
    """
    best: Optional[tuple[int, str]] = None
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, m)
    if not final and (best is None or partial_start(text, start, markers) < best[0]):
        raise Pending
    return best


BlockParser = Callable[[str, int, bool], tuple[list[ToolCall], int]]
NextBlock = Callable[[str, int, bool], tuple[str, Optional[int]]]


def parse_blocks(markup: str, final: bool, parse_block: BlockParser, next_block: NextBlock) -> tuple[
        list[ToolCall], str]:
    """The generic `_parse_markup`: a sequence of blocks, each all-or-nothing, from markup[0].

    parse_block(markup, pos, final) -> (calls, end): the block at pos (ValueError when malformed, Pending
    when cut). next_block(markup, end, final) -> (text between, offset of the next block or None at the
    end); may raise Pending when not final. The text between blocks is content unless whitespace only; from
    the first malformed block on, everything is content.
    """
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while True:
        try:
            block_calls, end = parse_block(markup, pos, final)
        except Pending:
            if not final:
                return calls, ""
            content.append(markup[pos:])
            return calls, "".join(content)
        except (ValueError, RecursionError):
            if final:
                content.append(markup[pos:])
            return calls, "".join(content)
        calls.extend(block_calls)
        try:
            between, nxt = next_block(markup, end, final)
        except Pending:
            return calls, ""
        if between.strip():
            content.append(between)
        if nxt is None:
            return calls, "".join(content)
        pos = nxt


def next_at_marker(markers: tuple[str, ...]) -> NextBlock:
    """A next_block for formats whose next block starts at the next of `markers`, anywhere after a block."""

    def next_block(markup: str, end: int, final: bool) -> tuple[str, Optional[int]]:
        found = first_marker(markup, end, markers, final)
        if found is None:
            return markup[end:], None
        return markup[end:found[0]], found[0]

    return next_block


class ToolParser:
    """One tool-call format: non-streamed parse, and a streaming state for one output.

    Subclasses set `name`, `start_markers` (what opens tool-call markup) and `markup_at_start_only` (the
    markup counts only at the start of the output, after whitespace), and implement `_parse_markup`.
    A parser instance streams one output; make a new one per output.
    """

    name: ClassVar[str]
    start_markers: ClassVar[tuple[str, ...]] = ()
    markup_at_start_only: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._text = ""  # the output so far
        self._markup_at: Optional[int] = None  # where markup starts, once known
        self._plain = False  # start-only formats: the output was found to be plain content
        self._searched = 0  # no start marker begins before this offset
        self._content_sent = 0  # content sent so far is self._text[:self._content_sent]
        self._calls_sent: list[ToolCall] = []
        self._finished = False

    # ---- format-specific -------------------------------------------------------------------------

    def _parse_markup(self, markup: str, final: bool) -> tuple[list[ToolCall], str]:
        """(calls, content) of `markup`, the text from the first start marker on.

        With final=False, `markup` may be cut anywhere: return only calls whose markup is complete (each
        must be the same call, at the same index, in the parse of any longer text); the content is ignored.
        With final=True, return all calls and the content as described in the module docstring.
        """
        raise NotImplementedError

    # ---- non-streamed ----------------------------------------------------------------------------

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls and content of a whole model output."""
        at = self._find_markup(text)
        if at is None:
            calls, content = [], text
        else:
            calls, rest = self._safe_parse(text[at:], final=True)
            content = text[:at] + rest
        return ExtractedToolCalls(content if content.strip() else None, calls)

    def _find_markup(self, text: str) -> Optional[int]:
        if self.markup_at_start_only:
            start = skip_ws(text, 0)
            return start if text.startswith(self.start_markers, start) else None
        found = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(found) if found else None

    def _safe_parse(self, markup: str, final: bool) -> tuple[list[ToolCall], str]:
        try:
            return self._parse_markup(markup, final)
        except Exception:  # a bug in a format module must not fail the request
            logger.exception("%s tool parser failed; treating the output as content", self.name)
            return [], markup

    # ---- streamed --------------------------------------------------------------------------------

    def extract_tool_calls_streaming(self, delta_text: str) -> Optional[DeltaResult]:
        """Take the next piece of the output; what can be sent now (None when nothing)."""
        if self._finished or not delta_text:
            return None
        self._text += delta_text
        text = self._text
        if self._plain:
            return self._send(text, [])
        if self._markup_at is None:
            safe = self._locate_markup(text)
            if self._markup_at is None:
                return self._send(text[:safe], [])
        calls, _ = self._safe_parse(text[self._markup_at:], final=False)
        return self._send(text[:self._markup_at], calls)

    def finish(self) -> Optional[DeltaResult]:
        """End of the output: whatever is still held back (None when nothing)."""
        if self._finished:
            return None
        self._finished = True
        result = self.extract_tool_calls(self._text)
        content = result.content or ""
        sent = self._text[:self._content_sent]
        if not content.startswith(sent):  # cannot happen if _parse_markup keeps its contract
            logger.error("%s tool parser: streamed content is not a prefix of the parsed content", self.name)
            content = sent
        if result.tool_calls[:len(self._calls_sent)] != self._calls_sent:
            logger.error("%s tool parser: streamed calls differ from the parsed calls", self.name)
        return self._emit(content[len(sent):], result.tool_calls)

    def _locate_markup(self, text: str) -> int:
        """Set self._markup_at (or self._plain) when the text so far decides it; the length of content
        that is safe to send (no start marker can begin before it)."""
        if self.markup_at_start_only:
            start = skip_ws(text, 0)
            rest = text[start:]
            if rest.startswith(self.start_markers):
                self._markup_at = start
                return start
            if not rest or any(m.startswith(rest) for m in self.start_markers):
                return start
            self._plain = True
            return len(text)
        held = partial_start(text, 0, self.start_markers)
        found = [i for i in (text.find(m, self._searched) for m in self.start_markers) if i >= 0]
        self._searched = max(0, len(text) - max(map(len, self.start_markers)) + 1)
        first = min(found) if found else len(text)
        if found and held >= first:
            self._markup_at = first
        return min(first, held)

    def _send(self, content: str, calls: list[ToolCall]) -> Optional[DeltaResult]:
        """Send `content` (a prefix of the final content) once it is not whitespace only, and new calls."""
        if self._content_sent == 0 and not content.strip():
            content = ""
        return self._emit(content[self._content_sent:], calls)

    def _emit(self, content: str, calls: list[ToolCall]) -> Optional[DeltaResult]:
        self._content_sent += len(content)
        deltas = []
        for call in calls[len(self._calls_sent):]:
            deltas.append(ToolCallDelta(index=len(self._calls_sent), name=call.name, arguments=call.arguments))
            self._calls_sent.append(call)
        if not content and not deltas:
            return None
        return DeltaResult(content=content or None, tool_calls=deltas)
