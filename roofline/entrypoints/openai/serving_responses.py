"""POST /v1/responses: OpenAI's Responses API (what the SDK's newer clients and the Agents SDK call), as a
translation onto the chat path (serving_chat.py), so tools, reasoning and structured outputs behave alike.

Request -> chat: `instructions` becomes a system message; `input` is text or a list of items -- messages
(content as text or input_text / output_text parts), `function_call` items (an assistant turn's tool
calls) and `function_call_output` items (tool results); `previous_response_id` puts the stored
conversation (its input and output) first.  Function `tools` and `tool_choice` map onto the chat ones;
`text.format` onto response_format; `max_output_tokens` onto max_completion_tokens.  Hosted tools (web
search, file search, computer use, ...) are a 400.
Chat -> response: output items `reasoning`, `message` (output_text) and `function_call`; status
"incomplete" with reason max_output_tokens when the length limit ended it.  Streaming sends the typed
events (response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta / .done, response.reasoning_text.delta / .done,
response.function_call_arguments.delta / .done, response.content_part.done, response.output_item.done,
response.completed), each with its sequence_number.
Responses are kept in memory (store, the default) for previous_response_id: at most MAX_STORED, each for
STORE_TTL_S seconds.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Optional, Union

from roofline.entrypoints.openai.protocol import ChatCompletionRequest, Int64, OpenAIModel
from roofline.entrypoints.openai.serving_chat import OpenAIServingChat
from roofline.entrypoints.openai.serving_engine import APIError, SSEStream, bad_request, parse_model

STORE_TTL_S = 3600.0
MAX_STORED = 2048


class ResponsesRequest(OpenAIModel):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Int64] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    stream: bool = False
    previous_response_id: Optional[str] = None
    store: bool = True
    text: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None  # effort / summary: the model thinks as its template says
    seed: Optional[Int64] = None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """Finished responses' conversations (chat messages, their output included), by response id."""

    def __init__(self, ttl_s: float = STORE_TTL_S, max_items: int = MAX_STORED) -> None:
        self.ttl_s, self.max_items = ttl_s, max_items
        self._items: "OrderedDict[str, tuple[float, list[dict[str, Any]]]]" = OrderedDict()

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._expire()
        self._items[response_id] = (time.monotonic() + self.ttl_s, messages)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Optional[list[dict[str, Any]]]:
        self._expire()
        item = self._items.get(response_id)
        return None if item is None else item[1]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items and next(iter(self._items.values()))[0] <= now:
            self._items.popitem(last=False)


# ------------------------------------------------------------------------------------ request -> chat
def _text_of(content: Any, where: str) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be text or a list of content parts", param="input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}: content part {kind!r} is not supported (input_text / output_text)",
                              param="input")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages (function calls grouped into one assistant turn)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                                  param="input")
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not all(isinstance(x, str) for x in (name, args, call_id)):
                raise bad_request(f"{where}: a function_call item has string name, arguments and call_id",
                                  param="input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise bad_request(f"{where}: a function_call_output item has string call_id and output",
                                  param="input")
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # earlier thinking: templates drop it from the history
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", param="input")
    return out


def chat_tools(req: ResponsesRequest) -> tuple[Optional[list[dict]], Any]:
    tools = None
    if req.tools is not None:
        tools = []
        for i, t in enumerate(req.tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise bad_request(f"tools[{i}]: only function tools are supported (no hosted tools), got {kind!r}",
                                  param="tools")
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request('a named tool_choice is {"type": "function", "name": ...}', param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def response_format(req: ResponsesRequest) -> Optional[dict[str, Any]]:
    fmt = (req.text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    raise bad_request(f"text.format type {fmt.get('type')!r} is not supported", param="text")


# ------------------------------------------------------------------------------------ the endpoint
class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.store = ResponseStore()

    async def create(self, req: ResponsesRequest, client: str = "") -> Any:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id)
            if stored is None:
                raise APIError(404, f"response {req.previous_response_id!r} is not stored here (unknown, or older "
                                    f"than {STORE_TTL_S:.0f} s)", "invalid_request_error", "previous_response_id")
            history = list(stored)
        messages = history + input_messages(req)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        tools, choice = chat_tools(req)
        body: dict[str, Any] = {"model": req.model, "messages": system + messages, "stream": req.stream,
                                "tools": tools, "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls,
                                "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                                "top_p": req.top_p, "response_format": response_format(req), "seed": req.seed,
                                "stream_options": {"include_usage": True} if req.stream else None}
        chat_req = parse_model(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})
        response_id = _new_id("resp")
        base = self._skeleton(req, response_id)
        result = await self.chat.create(chat_req, client)
        if req.stream:
            return SSEStream(self._stream(result, base, messages, req.store), result.streams)
        choice0 = result.choices[0]
        output = self._output_items(choice0.message)
        u = result.usage
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        response = self._finish(base, output, choice0.finish_reason, u.prompt_tokens, u.completion_tokens, cached)
        if req.store:
            self.store.put(response_id, messages + self._as_messages(output))
        return response

    def _skeleton(self, req: ResponsesRequest, response_id: str) -> dict[str, Any]:
        return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "model": self.chat.models.name_for(req.model), "output": [], "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "store": req.store, "metadata": req.metadata or {},
                "text": req.text or {"format": {"type": "text"}}, "error": None, "incomplete_details": None,
                "usage": None, "user": req.user}

    @staticmethod
    def _output_items(message: Any) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if message.reasoning_content:
            items.append({"type": "reasoning", "id": _new_id("rs"), "summary": [],
                          "content": [{"type": "reasoning_text", "text": message.reasoning_content}],
                          "status": "completed"})
        if message.content:
            items.append({"type": "message", "id": _new_id("msg"), "status": "completed", "role": "assistant",
                          "content": [{"type": "output_text", "text": message.content, "annotations": []}]})
        for call in message.tool_calls:
            items.append({"type": "function_call", "id": _new_id("fc"), "call_id": call.id,
                          "name": call.function.name, "arguments": call.function.arguments, "status": "completed"})
        return items

    @staticmethod
    def _as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The response's output as chat messages, for the conversation a later request continues."""
        text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
        calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"],
                                                                          "arguments": it["arguments"]}}
                 for it in output if it["type"] == "function_call"]
        msg: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = calls
        return [msg]

    @staticmethod
    def _finish(base: dict[str, Any], output: list[dict[str, Any]], finish_reason: Optional[str],
                input_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
        incomplete = finish_reason == "length"
        return {**base, "output": output, "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                          "total_tokens": input_tokens + output_tokens,
                          "input_tokens_details": {"cached_tokens": cached},
                          "output_tokens_details": {"reasoning_tokens": 0}}}

    # -- streaming: the chat stream's chunks as typed Responses events -------------------------------
    async def _stream(self, chat_stream: SSEStream, base: dict[str, Any], messages: list[dict[str, Any]],
                      store: bool) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        yield event("response.created", response=base)
        yield event("response.in_progress", response=base)
        output: list[dict[str, Any]] = []
        open_item: Optional[dict[str, Any]] = None  # the reasoning or message item being written
        calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> function_call item
        finish_reason, usage = None, None

        def close_open() -> list[str]:
            nonlocal open_item
            if open_item is None:
                return []
            it, idx = open_item, len(output) - 1
            open_item = None
            it["status"] = "completed"
            if it["type"] == "message":
                part = it["content"][0]
                return [event("response.output_text.done", item_id=it["id"], output_index=idx, content_index=0,
                              text=part["text"]),
                        event("response.content_part.done", item_id=it["id"], output_index=idx, content_index=0,
                              part=part),
                        event("response.output_item.done", output_index=idx, item=it)]
            part = it["content"][0]
            return [event("response.reasoning_text.done", item_id=it["id"], output_index=idx, content_index=0,
                          text=part["text"]),
                    event("response.output_item.done", output_index=idx, item=it)]

        def text_delta(kind: str, text: str) -> list[str]:
            nonlocal open_item
            out = []
            if open_item is None or open_item["type"] != kind:
                out += close_open()
                if kind == "message":
                    open_item = {"type": "message", "id": _new_id("msg"), "status": "in_progress", "role": "assistant",
                                 "content": [{"type": "output_text", "text": "", "annotations": []}]}
                else:
                    open_item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "status": "in_progress",
                                 "content": [{"type": "reasoning_text", "text": ""}]}
                output.append(open_item)
                idx = len(output) - 1
                out.append(event("response.output_item.added", output_index=idx,
                                 item={**open_item, "content": []}))
                if kind == "message":
                    out.append(event("response.content_part.added", item_id=open_item["id"], output_index=idx,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            open_item["content"][0]["text"] += text
            name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            out.append(event(name, item_id=open_item["id"], output_index=len(output) - 1, content_index=0, delta=text))
            return out

        async for raw in chat_stream:
            if not raw.startswith("data: {"):
                continue
            data = json.loads(raw[6:])
            if "error" in data:
                failed = {**base, "status": "failed", "output": output, "error": data["error"]}
                yield event("response.failed", response=failed)
                return
            if data.get("usage"):
                usage = data["usage"]
            for ch in data.get("choices", []):
                delta = ch.get("delta") or {}
                if delta.get("reasoning_content"):
                    for e in text_delta("reasoning", delta["reasoning_content"]):
                        yield e
                if delta.get("content"):
                    for e in text_delta("message", delta["content"]):
                        yield e
                for tc in delta.get("tool_calls") or []:
                    fn = tc.get("function") or {}
                    if tc["index"] not in calls:
                        for e in close_open():
                            yield e
                        item = {"type": "function_call", "id": _new_id("fc"), "call_id": tc.get("id"),
                                "name": fn.get("name"), "arguments": "", "status": "in_progress"}
                        calls[tc["index"]] = item
                        output.append(item)
                        yield event("response.output_item.added", output_index=len(output) - 1, item=dict(item))
                    item = calls[tc["index"]]
                    if fn.get("arguments"):
                        item["arguments"] += fn["arguments"]
                        yield event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=output.index(item), delta=fn["arguments"])
                if ch.get("finish_reason"):
                    finish_reason = ch["finish_reason"]
        for e in close_open():
            yield e
        for item in calls.values():
            item["status"] = "completed"
            idx = output.index(item)
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                        arguments=item["arguments"])
            yield event("response.output_item.done", output_index=idx, item=item)
        u = usage or {}
        final = self._finish(base, output, finish_reason, u.get("prompt_tokens", 0), u.get("completion_tokens", 0),
                             (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        if store:
            self.store.put(base["id"], messages + self._as_messages(output))
        yield event("response.completed", response=final)

