"""POST /v1/chat/completions: messages -> the model's chat template -> tokens -> completion."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from roofline.engine.async_llm import AsyncLLM
from roofline.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    FunctionCall,
    ToolCallOut,
    random_id,
)
from roofline.engine.chat_template import format_content
from roofline.entrypoints.openai.reasoning import get_reasoning_parser
from roofline.entrypoints.openai.structured_outputs import (
    attach_constraint,
    attach_structured_outputs,
    structured_outputs_of,
)
from roofline.entrypoints.openai.tool_calls import ChoiceParser, ToolRequest
from roofline.entrypoints.openai.tool_parsers import get_tool_parser
from roofline.entrypoints.openai.serving_models import ServingModels
from roofline.entrypoints.openai.tokenization import ServerTokenizer
from roofline.entrypoints.openai.serving_engine import (
    SSE_DONE,
    SSEStream,
    APIError,
    ChoiceState,
    DEFAULT_MAX_COMPLETIONS_PER_REQUEST,
    bad_request,
    build_sampling_params,
    check_finish,
    check_request_work,
    clamp_logprob,
    close_all,
    engine_error,
    make_usage,
    merge_streams,
    resolve_max_tokens,
    sse,
    sse_error,
    stop_reason_value,
    submit_all,
    token_text,
    top_entries,
)


def messages_to_dicts(messages: list[ChatMessage], content_format: str = "string") -> list[dict[str, Any]]:
    """OpenAI messages as a Jinja chat template takes them: content as one string or as text parts
    (content_format), an assistant's tool_calls with their arguments as objects (templates write them
    with tojson), a tool message's tool_call_id kept."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        content = m.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}]: content part of type {part.type!r} is not supported "
                                      "(only text)", param="messages")
            content = [{"type": "text", "text": part.text} for part in content]
        d["content"] = format_content(content, content_format)
        calls = d.get("tool_calls")
        if calls is not None:
            d["tool_calls"] = _template_tool_calls(calls, i)
        out.append(d)
    return out


def _template_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", param="messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"messages[{i}].tool_calls: each call is {{\"id\", \"type\": \"function\", "
                              f"\"function\": {{\"name\", \"arguments\"}}}}", param="messages")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # the template gets the text as it came
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


async def apply_chat_template(tokenizer: Optional[ServerTokenizer], messages: list[ChatMessage], *,
                              add_generation_prompt: bool = True, continue_final_message: bool = False,
                              tools: Any = None, chat_template: Optional[str] = None,
                              kwargs: Optional[dict] = None, client: str = "",
                              content_format: str = "string") -> tuple[str, list[int]]:
    """Render the conversation and tokenize it, off the event loop (tokenization.py)."""
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    if tokenizer is None:
        raise bad_request("this model has no tokenizer (and so no chat template); use /v1/completions "
                          "with token ids", param="messages")
    if (chat_template is None and tokenizer.chat_template is None
            and getattr(tokenizer.base, "chat_template", None) is None):
        raise bad_request("the model has no chat template (start the server with --chat-template); use "
                          "/v1/completions", param="messages")
    text = await tokenizer.render_chat(messages_to_dicts(messages, content_format),
                                       add_generation_prompt=add_generation_prompt and not continue_final_message,
                                       continue_final_message=continue_final_message,
                                       tools=tools, chat_template=chat_template, kwargs=kwargs, client=client)
    ids = await tokenizer.encode(text, add_special_tokens=False, field="messages")
    return text, ids


@dataclass
class ChatOptions:
    """The server's chat settings (serve flags of the same names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    chat_template_content_format: str = "string"  # resolved: "string" | "openai"

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # unknown names fail at start-up, naming the flag
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


class OpenAIServingChat:
    def __init__(self, engine: AsyncLLM, tokenizer: Optional[ServerTokenizer], models: ServingModels,
                 max_model_len: int, max_completions: int = DEFAULT_MAX_COMPLETIONS_PER_REQUEST,
                 options: Optional[ChatOptions] = None) -> None:
        self.max_completions = max_completions
        self.engine = engine
        self.tokenizer = tokenizer
        self.text_tokenizer = tokenizer.loop if tokenizer is not None else None  # short decodes, on the loop
        self.models = models  # the base model's names and the LoRA adapters served (serving_models.py)
        self.max_model_len = max_model_len
        self.options = options or ChatOptions()

    async def create(self, req: ChatCompletionRequest, client: str = "") -> Any:
        """client: the sender's address (the cap on request chat templates in flight is per client)."""
        self.models.check(req.model)  # 404 for a name not served (never the base model in its place)
        tools = ToolRequest.from_request(req, self.options.enable_auto_tool_choice)
        check_request_work(1, req.n, self.max_completions)
        text, ids = await apply_chat_template(
            self.tokenizer, req.messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, tools=tools.tools if tools else None,
            chat_template=req.chat_template, kwargs=req.chat_template_kwargs, client=client,
            content_format=self.options.chat_template_content_format)
        if not ids:
            raise bad_request("the rendered prompt is empty", param="messages")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(requested, len(ids), self.max_model_len, "messages", field)
        logprobs = None
        if req.logprobs:
            logprobs = req.top_logprobs or 0
        elif req.top_logprobs is not None and req.top_logprobs > 0:
            raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
        params = build_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
        tool_constraint = tools.structured_outputs() if tools is not None else None
        if tool_constraint is not None:
            other, _ = structured_outputs_of(req)
            if other is not None:
                raise bad_request(f"tool_choice {tools.choice!r} constrains the output already; it cannot be "
                                  f"combined with {other}", param=other)
            await attach_constraint(self.engine, tool_constraint, "tools", params)
        else:
            await attach_structured_outputs(self.engine, req, params)
        self._gate_constraint_on_reasoning(params, req, text)
        request_id = random_id("chatcmpl")
        streams = await submit_all(self.engine, request_id, [(text, ids)], params, req.priority, "messages",
                                   lora_request=self.models.lora_for(req.model))
        parsers = [self._choice_parser(req, tools, text) for _ in range(req.n)]
        echo = self._echo(req)
        if req.stream:
            return SSEStream(self._stream(req, request_id, len(ids), streams, parsers, echo), streams)
        return await self._full(req, request_id, len(ids), streams, parsers, echo)

    def _choice_parser(self, req: ChatCompletionRequest, tools: Optional[ToolRequest], prompt_text: str) -> ChoiceParser:
        o = self.options
        base = self.tokenizer.base if self.tokenizer is not None else None
        reasoning = (get_reasoning_parser(o.reasoning_parser)(base, req.chat_template_kwargs)
                     if o.reasoning_parser else None)
        tool_parser = get_tool_parser(o.tool_call_parser)(base) if o.tool_call_parser and tools is not None else None
        return ChoiceParser(reasoning, tools, tool_parser, prompt_text)

    def _gate_constraint_on_reasoning(self, params: Any, req: ChatCompletionRequest, prompt_text: str) -> None:
        """With a reasoning parser, a constraint (structured outputs, required / named tools) applies to the
        answer after the thinking: the grammar starts once the model emits the end-of-think token."""
        so = params.structured_outputs
        if so is None or not self.options.reasoning_parser:
            return
        parser = get_reasoning_parser(self.options.reasoning_parser)(
            self.tokenizer.base if self.tokenizer is not None else None, req.chat_template_kwargs)
        if parser.reasoning_enabled(prompt_text) and parser.end_token_id is not None:
            params.structured_outputs = dataclasses.replace(so, start_after_token_id=parser.end_token_id)

    @staticmethod
    def _echo(req: ChatCompletionRequest) -> str:
        """echo: the last message's text when it is the assistant's (the answer continues it)."""
        if not req.echo or not req.messages or req.messages[-1].role != "assistant":
            return ""
        content = req.messages[-1].content
        if isinstance(content, list):
            return "\n".join(p.text or "" for p in content)
        return content or ""

    def _logprobs(self, token_ids: list[int], positions: list[Any], k: int) -> ChatChoiceLogprobs:
        content = []
        for tid, d in zip(token_ids, positions):
            entry = d.get(tid) if d else None
            tok = token_text(self.text_tokenizer, tid, entry)
            top = []
            for t, v in top_entries(d or {}, k):
                s = token_text(self.text_tokenizer, t, v)
                top.append(ChatTopLogprob(token=s, logprob=clamp_logprob(v.logprob),
                                          bytes=list(s.encode("utf-8"))))
            content.append(ChatTokenLogprob(
                token=tok, logprob=clamp_logprob(entry.logprob) if entry is not None else -9999.0,
                bytes=list(tok.encode("utf-8")), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    async def _full(self, req: ChatCompletionRequest, request_id: str, prompt_len: int, streams: list,
                    parsers: list[ChoiceParser], echo: str) -> ChatCompletionResponse:
        choices = [ChoiceState() for _ in range(req.n)]
        cached = 0
        kv_transfer_params = None
        merged = merge_streams(streams)
        try:
            async for _, ro in merged:
                cached = max(cached, ro.num_cached_tokens or 0)
                kv_transfer_params = ro.kv_transfer_params or kv_transfer_params
                for comp in ro.outputs:
                    check_finish(comp)
                    st = choices[comp.index]
                    st.text += comp.text
                    st.token_ids.extend(comp.token_ids)
                    if comp.logprobs is not None:
                        st.logprobs.extend(comp.logprobs)
                    if comp.finish_reason is not None:
                        st.finish_reason, st.stop_reason = comp.finish_reason, comp.stop_reason
        except Exception as e:
            raise engine_error(self.engine, e, request_id=request_id) from e
        finally:
            await close_all(streams, merged)
        out = []
        for idx, st in enumerate(choices):
            lp = None
            if req.logprobs:
                lp = self._logprobs(st.token_ids, st.logprobs, req.top_logprobs or 0)
            parsed = parsers[idx].parse(st.text)
            calls = [ToolCallOut(id=cid, function=FunctionCall(name=c.name, arguments=c.arguments))
                     for cid, c in parsed.tool_calls]
            content = parsed.content
            if echo:
                content = echo + (content or "")
            message = ChatResponseMessage(role="assistant", content=content, reasoning_content=parsed.reasoning,
                                          reasoning=parsed.reasoning, tool_calls=calls)
            finish = "tool_calls" if calls and st.finish_reason == "stop" else st.finish_reason
            out.append(ChatCompletionResponseChoice(index=idx, message=message, logprobs=lp, finish_reason=finish,
                                                    stop_reason=stop_reason_value(st.stop_reason)))
        usage = make_usage([prompt_len], sum(len(c.token_ids) for c in choices), cached)
        return ChatCompletionResponse(id=request_id, model=self.models.name_for(req.model), choices=out,
                                      usage=usage, kv_transfer_params=kv_transfer_params)

    async def _stream(self, req: ChatCompletionRequest, request_id: str, prompt_len: int, streams: list,
                      parsers: list[ChoiceParser], echo: str) -> AsyncIterator[str]:
        created, model = int(time.time()), self.models.name_for(req.model)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        num_tokens = [0] * req.n
        cached = 0

        def chunk(idx: int, delta: dict, logprobs: Any = None, finish: Optional[str] = None,
                  stop_reason: Any = None) -> str:
            d: dict[str, Any] = {
                "id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model,
                "choices": [{"index": idx, "delta": delta,
                             "logprobs": logprobs.model_dump(mode="json") if logprobs is not None else None,
                             "finish_reason": finish, "stop_reason": stop_reason_value(stop_reason)}],
            }
            if continuous:
                d["usage"] = make_usage([prompt_len], sum(num_tokens), cached).model_dump(mode="json")
            elif include_usage:
                d["usage"] = None
            return sse(d)

        merged = merge_streams(streams)
        try:
            for idx in range(req.n):
                yield chunk(idx, {"role": "assistant", "content": echo})
            async for _, ro in merged:
                cached = max(cached, ro.num_cached_tokens or 0)
                for comp in ro.outputs:
                    check_finish(comp)
                    num_tokens[comp.index] += len(comp.token_ids)
                    lp = None
                    if req.logprobs and comp.logprobs is not None:
                        lp = self._logprobs(comp.token_ids, comp.logprobs, req.top_logprobs or 0)
                    parser = parsers[comp.index]
                    delta = parser.delta(comp.text) if comp.text else None
                    finish = comp.finish_reason
                    if finish is not None:
                        tail = parser.finish()
                        if delta is None:
                            delta = tail
                        elif tail:
                            if delta.tool_calls or tail.tool_calls or (delta.content and tail.reasoning):
                                yield chunk(comp.index, delta.message(), lp)  # keep the pieces in order
                                lp, delta = None, tail
                            else:
                                delta.reasoning += tail.reasoning
                                delta.content += tail.content
                        if parser.num_calls and finish == "stop":
                            finish = "tool_calls"
                    if not delta and finish is None and lp is None:
                        continue
                    yield chunk(comp.index, delta.message() if delta else {}, lp, finish, comp.stop_reason)
            if include_usage:
                usage = make_usage([prompt_len], sum(num_tokens), cached)
                yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [], "usage": usage.model_dump(mode="json")})
        except APIError as e:
            yield sse_error(e)
        except Exception as e:
            yield sse_error(engine_error(self.engine, e, request_id=request_id))
        finally:
            await close_all(streams, merged)
        yield SSE_DONE
