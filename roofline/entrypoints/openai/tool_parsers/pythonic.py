"""Pythonic tool calls (Llama 3.2, Llama 4): the output is a Python list of calls with keyword arguments.

    [get_weather(city="Paris", days=3), get_time()]
    <|python_start|>[get_weather(city="Paris")]<|python_end|>

The output is tool calls only when it starts (after whitespace) with `[` or <|python_start|>; the list is
parsed with `ast`, never evaluated. Argument values are literals: strings, numbers, True/False/None (and
true/false/null), lists, tuples (as lists) and dicts with string keys. A function name may be dotted
(`brave_search.call`). Text after the list (and after <|python_end|>) is content unless whitespace only.
The list is all-or-nothing: anything else (positional arguments, expressions, an empty or unclosed list,
plain text in brackets) makes the whole output content.
"""

from __future__ import annotations

import ast
import warnings
from typing import Any, Optional

from roofline.entrypoints.openai.tool_parsers.base import (MalformedCall, Pending, ToolCall, ToolParser,
                                                           dump_arguments, parse_blocks, skip_ws)

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_NAMED = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _list_end(src: str, pos: int) -> Optional[int]:
    """The offset after the bracket that closes the one at src[pos] (strings and comments skipped), or None."""
    depth, n = 0, len(src)
    while pos < n:
        c = src[pos]
        if c == '"' or c == "'":
            quote = c * 3 if src.startswith(c * 3, pos) else c
            pos += len(quote)
            while not src.startswith(quote, pos):
                if pos >= n or (len(quote) == 1 and src[pos] == "\n"):
                    return None
                pos += 2 if src[pos] == "\\" else 1
            pos += len(quote)
            continue
        if c == "#":
            pos = src.find("\n", pos)
            if pos < 0:
                return None
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return pos + 1
        pos += 1
    return None


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, bool, int, float)):
            return node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(
            node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise MalformedCall("a dict key is not a string")
            out[k.value] = _value(v)
        return out
    elif isinstance(node, ast.Name) and node.id in _NAMED:
        return _NAMED[node.id]
    raise MalformedCall(f"not a literal: {type(node).__name__}")


def _func_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_func_name(node.value)}.{node.attr}"
    raise MalformedCall("the called thing is not a name")


def _call(node: ast.AST) -> ToolCall:
    if not isinstance(node, ast.Call):
        raise MalformedCall("a list element is not a call")
    if node.args or any(kw.arg is None for kw in node.keywords):
        raise MalformedCall("positional or ** arguments")
    return ToolCall(_func_name(node.func), dump_arguments({kw.arg: _value(kw.value) for kw in node.keywords}))


def _parse_block(markup: str, pos: int, final: bool) -> tuple[list[ToolCall], int]:
    if markup.startswith(PYTHON_START, pos):
        pos = skip_ws(markup, pos + len(PYTHON_START))
    if pos == len(markup):
        raise Pending
    if markup[pos] != "[":
        raise MalformedCall("not a list")
    # Parse only when the list may have closed: the text ends with "]" or holds <|python_end|>.
    if not final and not markup.rstrip().endswith("]") and PYTHON_END not in markup:
        raise Pending
    end = _list_end(markup, pos)
    if end is None:
        raise Pending
    try:
        with warnings.catch_warnings():  # invalid escape sequences in strings warn
            warnings.simplefilter("ignore")
            tree = ast.parse(markup[pos:end], mode="eval")
    except (SyntaxError, ValueError, MemoryError) as e:
        raise MalformedCall(f"not a Python list: {e}") from None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        raise MalformedCall("not a non-empty list")
    calls = [_call(e) for e in tree.body.elts]
    after = skip_ws(markup, end)
    return calls, after + len(PYTHON_END) if markup.startswith(PYTHON_END, after) else end


def _next_block(markup: str, end: int, final: bool) -> tuple[str, Optional[int]]:
    if not final:
        raise Pending
    return markup[end:], None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    start_markers = ("[", PYTHON_START)
    markup_at_start_only = True

    def _parse_markup(self, markup: str, final: bool) -> tuple[list[ToolCall], str]:
        return parse_blocks(markup, final, _parse_block, _next_block)
