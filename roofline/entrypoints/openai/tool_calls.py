"""Tool calling on /v1/chat/completions: what a request asks (tools, tool_choice) and how a choice's text
becomes reasoning, content and tool calls.

Request side (ToolRequest.from_request): the deprecated functions / function_call are mapped onto tools /
tool_choice; every tool is checked (a function with a name and, when given, a JSON-schema object as
parameters); tool_choice is one of
  "none"      the tools are shown to the template, no call is ever returned;
  "auto"      the model decides, its text is parsed by --tool-call-parser (needs --enable-auto-tool-choice);
  "required"  the output is constrained (structured outputs) to a JSON array of {"name", "parameters"}
              items, each validating against its tool's schema: at least one call, whatever the model;
  {"type": "function", "function": {"name": N}}  the output is constrained to N's parameters schema.
A request with tools and no tool_choice is "auto" (OpenAI's default).

Output side (ChoiceParser): per choice, the reasoning parser (when the server has one) takes the thinking
out first; the rest is content, or tool calls by the mode above.  Streaming and whole-text paths give
the same result: the concatenated deltas equal the whole-text fields, each call's first delta carries its
index, id and name, and its argument fragments concatenate to its arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from roofline.entrypoints.openai.reasoning.base import ReasoningParser
from roofline.entrypoints.openai.serving_engine import bad_request
from roofline.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser
from roofline.sampling_params import StructuredOutputsParams

NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]]  # [{"type": "function", "function": {...}}], as the template gets them
    choice: str  # "none" | "auto" | "required" | "named"
    named: Optional[str] = None  # the function of a named choice
    parallel: bool = True  # parallel_tool_calls (false: at most one call)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    @classmethod
    def from_request(cls, req: Any, auto_enabled: bool) -> Optional["ToolRequest"]:
        """None when the request has no tools and no tool_choice (plain chat)."""
        tools, choice = req.tools, req.tool_choice
        if req.functions is not None or req.function_call is not None:  # OpenAI's deprecated form
            if tools is not None or choice is not None:
                raise bad_request("give tools / tool_choice or the deprecated functions / function_call, not both",
                                  param="functions")
            if req.functions is not None:
                if not isinstance(req.functions, list):
                    raise bad_request("functions must be a list of function definitions", param="functions")
                tools = [{"type": "function", "function": f} for f in req.functions]
            fc = req.function_call
            if isinstance(fc, dict):
                choice = {"type": "function", "function": {"name": fc.get("name")}}
            else:
                choice = fc
        if tools is None and choice in (None, "none"):
            return None
        tools = cls._check_tools(tools or [], "tools" if req.functions is None else "functions")
        names = [t["function"]["name"] for t in tools]
        param = "tool_choice" if req.function_call is None else "function_call"
        if choice is None:
            choice = "auto" if tools else "none"
        named = None
        if isinstance(choice, dict):
            fn = choice.get("function") if choice.get("type") == "function" else None
            named = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(named, str):
                raise bad_request('a named tool_choice is {"type": "function", "function": {"name": ...}}', param=param)
            if named not in names:
                raise bad_request(f"tool_choice names the function {named!r}, which is not in tools "
                                  f"({', '.join(names) or 'none given'})", param=param)
            choice = "named"
        elif choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                              param=param)
        if choice == "required" and not tools:
            raise bad_request('tool_choice "required" needs at least one tool in tools', param=param)
        if choice == "auto" and not auto_enabled:
            raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                              '--tool-call-parser (or send tool_choice "required", a named function or "none")',
                              param=param)
        parallel = req.parallel_tool_calls is not False
        return cls(tools, choice, named, parallel)

    @staticmethod
    def _check_tools(tools: Any, param: str) -> list[dict[str, Any]]:
        if not isinstance(tools, list):
            raise bad_request(f"{param} must be a list of tools", param=param)
        out, seen = [], set()
        for i, t in enumerate(tools):
            where = f"{param}[{i}]"
            if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
                raise bad_request(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": '
                                  '{...}}}} (only function tools are supported)', param=param)
            fn = t["function"]
            name = fn.get("name")
            if not isinstance(name, str) or not NAME_RE.match(name):
                raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '-', '.' or ':', "
                                  f"got {name!r}", param=param)
            if name in seen:
                raise bad_request(f"{where}: the function name {name!r} appears twice", param=param)
            seen.add(name)
            params = fn.get("parameters")
            if params is not None and (not isinstance(params, dict) or not isinstance(params.get("type", "object"), str)
                                       and not isinstance(params.get("type"), list)):
                raise bad_request(f"{where}.function.parameters must be a JSON schema (an object)", param=param)
            if fn.get("description") is not None and not isinstance(fn["description"], str):
                raise bad_request(f"{where}.function.description must be a string", param=param)
            out.append({"type": "function", "function": fn})
        return out

    def parameters(self, name: str) -> dict[str, Any]:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """The constraint of a required or named choice (compact JSON: what the model writes is the
        arguments text as returned); None otherwise."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self.parameters(self.named), disable_any_whitespace=True)
        if self.choice == "required":
            item = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                                  "parameters": self.parameters(t["function"]["name"])},
                               "required": ["name", "parameters"], "additionalProperties": False}
                              for t in self.tools]}
            schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return None


# ---------------------------------------------------------------------------------------- output side
@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's delta form, index/id/function

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def message(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.reasoning:
            d["reasoning_content"] = d["reasoning"] = self.reasoning
        if self.content:
            d["content"] = self.content
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        return d


@dataclass
class ChoiceResult:
    reasoning: Optional[str]
    content: Optional[str]
    tool_calls: list[tuple[str, ToolCall]]  # (id, call)


class _ConstrainedCalls:
    """The calls of a required or named choice, from the constrained JSON text (whole and streamed)."""

    def __init__(self, tools: ToolRequest) -> None:
        self.tools = tools
        self.text = ""
        self.emitted = 0  # calls sent (required), or 1 once the named call's name went out

    def calls(self, text: str) -> list[ToolCall]:
        """The calls in text: a named choice's arguments; a required choice's array items whose JSON is
        complete (all of them, or those before the length limit cut the array)."""
        if self.tools.choice == "named":
            return [ToolCall(self.tools.named, text)] if text.strip() else []
        calls, dec, pos = [], json.JSONDecoder(), text.find("[")
        if pos < 0:
            return []
        pos += 1
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            try:
                item, pos = dec.raw_decode(text, pos)
            except ValueError:
                return calls
            if isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item:
                calls.append(ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))

    def stream(self, delta: str) -> list[tuple[int, Optional[str], str]]:
        """(index, name or None, arguments fragment) for the new text."""
        self.text += delta
        if self.tools.choice == "named":
            out = []
            if delta:
                out.append((0, self.tools.named if not self.emitted else None, delta))
                self.emitted = 1
            return out
        return [(i, c.name, c.arguments) for i, c in self._complete_items()]

    def finish(self) -> list[tuple[int, Optional[str], str]]:
        if self.tools.choice == "named":
            return []
        return [(i, c.name, c.arguments) for i, c in self._complete_items()]

    def _complete_items(self) -> list[tuple[int, ToolCall]]:
        """Array items completed since the last call (their JSON closed)."""
        calls = self.calls(self.text)
        new = list(enumerate(calls))[self.emitted:]
        self.emitted = len(calls)
        return new


class ChoiceParser:
    """One choice's output text -> reasoning, content and tool calls, as it streams or at once."""

    def __init__(self, reasoning: Optional[ReasoningParser], tools: Optional[ToolRequest],
                 tool_parser: Optional[ToolParser], prompt_text: str = "") -> None:
        self.reasoning = reasoning
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.tool_parser = tool_parser if self.tools is not None and self.tools.choice == "auto" else None
        self.constrained = _ConstrainedCalls(self.tools) if self.tools is not None and self.tools.constrained else None
        self.prompt_text = prompt_text
        if reasoning is not None:
            reasoning.reset(prompt_text)
        self.ids: list[str] = []  # per call index
        self.num_calls = 0

    # -- whole text --------------------------------------------------------------------------------
    def parse(self, text: str) -> ChoiceResult:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text, self.prompt_text)
        calls: list[ToolCall] = []
        if self.constrained is not None:
            calls, content = self.constrained.calls(content or ""), None
        elif self.tool_parser is not None and content:
            got = self.tool_parser.extract_tool_calls(content)
            calls, content = got.tool_calls, got.content
        if self.tools is not None and not self.tools.parallel:
            calls = calls[:1]
        return ChoiceResult(reasoning, content, [(tool_call_id(), c) for c in calls])

    # -- streaming ---------------------------------------------------------------------------------
    def delta(self, text: str) -> ChoiceDelta:
        out = ChoiceDelta()
        content = text
        if self.reasoning is not None:
            r, content = self.reasoning.extract_reasoning_streaming(text)
            out.reasoning = r or ""
            content = content or ""
        self._content(content, out, final=False)
        return out

    def finish(self) -> ChoiceDelta:
        out = ChoiceDelta()
        content = ""
        if self.reasoning is not None:
            r, content = self.reasoning.finish()
            out.reasoning = r or ""
            content = content or ""
        self._content(content, out, final=True)
        return out

    def _content(self, content: str, out: ChoiceDelta, final: bool) -> None:
        if self.constrained is not None:
            pieces = self.constrained.stream(content) if content else []
            if final:
                pieces += self.constrained.finish()
            for index, name, args in pieces:
                self._call_delta(out, index, name, args)
            return
        if self.tool_parser is None:
            out.content += content
            return
        results = []
        if content:
            results.append(self.tool_parser.extract_tool_calls_streaming(content))
        if final:
            results.append(self.tool_parser.finish())
        for r in results:
            if r is None:
                continue
            out.content += r.content or ""
            for d in r.tool_calls:
                self._call_delta(out, d.index, d.name, d.arguments)

    def _call_delta(self, out: ChoiceDelta, index: int, name: Optional[str], arguments: Optional[str]) -> None:
        if self.tools is not None and not self.tools.parallel and index > 0:
            return  # parallel_tool_calls false: the first call only
        d: dict[str, Any] = {"index": index}
        fn: dict[str, Any] = {}
        if name is not None:
            while len(self.ids) <= index:
                self.ids.append(tool_call_id())
            d["id"], d["type"] = self.ids[index], "function"
            fn["name"] = name
            fn["arguments"] = arguments or ""
        elif arguments:
            fn["arguments"] = arguments
        else:
            return
        d["function"] = fn
        self.num_calls = max(self.num_calls, index + 1)
        out.tool_calls.append(d)
