"""POST /v1/chat/completions: messages -> the model's chat template -> tokens -> completion."""

from __future__ import annotations

import time
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
    random_id,
)
from roofline.entrypoints.openai.structured_outputs import attach_structured_outputs
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


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Flatten OpenAI messages for a Jinja chat template (text content parts are joined)."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}]: content part of type {part.type!r} is not supported "
                                      "(only text)", param="messages")
                texts.append(part.text)
            d["content"] = "\n".join(texts)
        elif content is None:
            d["content"] = ""
        out.append(d)
    return out


async def apply_chat_template(tokenizer: Optional[ServerTokenizer], messages: list[ChatMessage], *,
                              add_generation_prompt: bool = True, continue_final_message: bool = False,
                              tools: Any = None, chat_template: Optional[str] = None,
                              kwargs: Optional[dict] = None, client: str = "") -> tuple[str, list[int]]:
    """Render the conversation and tokenize it, off the event loop (tokenization.py)."""
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    if tokenizer is None:
        raise bad_request("this model has no tokenizer (and so no chat template); use /v1/completions "
                          "with token ids", param="messages")
    if chat_template is None and getattr(tokenizer.base, "chat_template", None) is None:
        raise bad_request("the model has no chat template; use /v1/completions", param="messages")
    text = await tokenizer.render_chat(messages_to_dicts(messages), add_generation_prompt=add_generation_prompt and
                                       not continue_final_message, continue_final_message=continue_final_message,
                                       tools=tools, chat_template=chat_template, kwargs=kwargs, client=client)
    ids = await tokenizer.encode(text, add_special_tokens=False, field="messages")
    return text, ids


def check_tools(req: ChatCompletionRequest) -> None:
    """Tool calling is not implemented: a request that asks for it gets a 400 instead of being silently
    answered in plain text.  tools with tool_choice "none" are fine (the model may not call them)."""
    if req.functions or req.function_call not in (None, "none"):
        raise bad_request("function calling is not supported by this server", param="functions")
    if req.tools and req.tool_choice != "none":
        raise bad_request("tool calling is not supported by this server (send tool_choice \"none\" to "
                          "show the tools to the model without calls)", param="tools")
    if req.tool_choice not in (None, "none"):
        raise bad_request("tool calling is not supported by this server", param="tool_choice")


class OpenAIServingChat:
    def __init__(self, engine: AsyncLLM, tokenizer: Optional[ServerTokenizer], model_name: str,
                 max_model_len: int, max_completions: int = DEFAULT_MAX_COMPLETIONS_PER_REQUEST) -> None:
        self.max_completions = max_completions
        self.engine = engine
        self.tokenizer = tokenizer
        self.text_tokenizer = tokenizer.loop if tokenizer is not None else None  # short decodes, on the loop
        self.model_name = model_name
        self.max_model_len = max_model_len

    async def create(self, req: ChatCompletionRequest, client: str = "") -> Any:
        """client: the sender's address (the cap on request chat templates in flight is per client)."""
        check_tools(req)
        check_request_work(1, req.n, self.max_completions)
        text, ids = await apply_chat_template(
            self.tokenizer, req.messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, tools=req.tools,
            chat_template=req.chat_template, kwargs=req.chat_template_kwargs, client=client)
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
        await attach_structured_outputs(self.engine, req, params)
        request_id = random_id("chatcmpl")
        streams = await submit_all(self.engine, request_id, [(text, ids)], params, req.priority, "messages")
        if req.stream:
            return SSEStream(self._stream(req, request_id, len(ids), streams), streams)
        return await self._full(req, request_id, len(ids), streams)

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
                    ) -> ChatCompletionResponse:
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
            out.append(ChatCompletionResponseChoice(
                index=idx, message=ChatResponseMessage(role="assistant", content=st.text), logprobs=lp,
                finish_reason=st.finish_reason, stop_reason=stop_reason_value(st.stop_reason)))
        usage = make_usage([prompt_len], sum(len(c.token_ids) for c in choices), cached)
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=out, usage=usage,
                                      kv_transfer_params=kv_transfer_params)

    async def _stream(self, req: ChatCompletionRequest, request_id: str, prompt_len: int, streams: list,
                      ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        num_tokens = [0] * req.n
        cached = 0

        def chunk(idx: int, delta: dict, logprobs: Any = None, finish: Optional[str] = None,
                  stop_reason: Any = None) -> str:
            d: dict[str, Any] = {
                "id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name,
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
                yield chunk(idx, {"role": "assistant", "content": ""})
            async for _, ro in merged:
                cached = max(cached, ro.num_cached_tokens or 0)
                for comp in ro.outputs:
                    check_finish(comp)
                    num_tokens[comp.index] += len(comp.token_ids)
                    lp = None
                    if req.logprobs and comp.logprobs is not None:
                        lp = self._logprobs(comp.token_ids, comp.logprobs, req.top_logprobs or 0)
                    if not comp.text and comp.finish_reason is None and lp is None:
                        continue
                    delta = {"content": comp.text} if comp.text else {}
                    yield chunk(comp.index, delta, lp, comp.finish_reason, comp.stop_reason)
            if include_usage:
                usage = make_usage([prompt_len], sum(num_tokens), cached)
                yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                           "model": self.model_name, "choices": [], "usage": usage.model_dump(mode="json")})
        except APIError as e:
            yield sse_error(e)
        except Exception as e:
            yield sse_error(engine_error(self.engine, e, request_id=request_id))
        finally:
            await close_all(streams, merged)
        yield SSE_DONE
