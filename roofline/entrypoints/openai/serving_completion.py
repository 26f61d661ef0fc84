"""POST /v1/completions."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator, Optional

from roofline.engine.async_llm import AsyncLLM
from roofline.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    random_id,
)
from roofline.entrypoints.openai.structured_outputs import attach_structured_outputs
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
    close_all,
    clamp_logprob,
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
from roofline.outputs import CompletionOutput


class OpenAIServingCompletion:
    def __init__(self, engine: AsyncLLM, tokenizer: Optional[ServerTokenizer], models: ServingModels,
                 max_model_len: int, max_completions: int = DEFAULT_MAX_COMPLETIONS_PER_REQUEST) -> None:
        self.max_completions = max_completions
        self.engine = engine
        self.tokenizer = tokenizer
        self.text_tokenizer = tokenizer.loop if tokenizer is not None else None  # short decodes, on the loop
        self.models = models  # the base model's names and the LoRA adapters served (serving_models.py)
        self.max_model_len = max_model_len

    async def _prompts(self, req: CompletionRequest) -> list[tuple[Optional[str], list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif len(p) == 0:
            raise bad_request("prompt must not be empty", param="prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        check_request_work(len(items), req.n, self.max_completions)
        prompts = []
        for item in items:
            if isinstance(item, str):
                if self.tokenizer is None:
                    raise bad_request("this model has no tokenizer: send the prompt as token ids", param="prompt")
                ids = await self.tokenizer.encode(item)
                prompts.append((item, ids))
            else:
                if len(item) == 0:
                    raise bad_request("prompt must not be empty", param="prompt")
                prompts.append((None, list(item)))
            if len(prompts[-1][1]) == 0:
                raise bad_request("prompt must not be empty", param="prompt")
        return prompts

    async def create(self, req: CompletionRequest) -> Any:
        """Returns a CompletionResponse, or an async iterator of SSE strings when streaming."""
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (only best_of == n)", param="best_of")
        self.models.check(req.model)  # 404 for a name not served (never the base model in its place)
        prompts = await self._prompts(req)
        if req.kv_transfer_params is not None and len(prompts) != 1:
            raise bad_request("kv_transfer_params needs a single prompt", param="kv_transfer_params")
        if req.echo and self.tokenizer is None:
            raise bad_request("echo needs a tokenizer, and this model has none", param="echo")
        # echo with max_tokens=0 scores the prompt only (how eval harnesses get prompt logprobs):
        # the engine generates one token, which is not returned.
        prompt_only = req.echo and req.max_tokens == 0
        requested = 1 if prompt_only else req.max_tokens
        max_tokens = None
        for _, ids in prompts:
            max_tokens = resolve_max_tokens(requested, len(ids), self.max_model_len, "prompt")
        if requested is None:  # several prompts: the tightest budget
            max_tokens = min(self.max_model_len - len(ids) for _, ids in prompts)
        want_prompt_lp = req.echo and req.logprobs is not None
        params = build_sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                       prompt_logprobs=req.logprobs if want_prompt_lp else None)
        await attach_structured_outputs(self.engine, req, params)
        request_id = random_id("cmpl")
        streams = await submit_all(self.engine, request_id, prompts, params, req.priority,
                                   lora_request=self.models.lora_for(req.model))
        if req.stream:
            return SSEStream(self._stream(req, request_id, prompts, streams, prompt_only), streams)
        return await self._full(req, request_id, prompts, streams, prompt_only)

    @staticmethod
    def _visible(comp: CompletionOutput, prompt_only: bool) -> CompletionOutput:
        """What the client sees of a completion (nothing but the finish, when scoring the prompt)."""
        if not prompt_only:
            return comp
        return dataclasses.replace(comp, text="", token_ids=[], logprobs=[] if comp.logprobs is not None else None,
                                   finish_reason="length" if comp.finish_reason else None, stop_reason=None)

    # ------------------------------------------------------------------ logprobs
    def _logprobs(self, comp_ids: list[int], positions: list[Any], k: int, start_offset: int,
                  ) -> CompletionLogProbs:
        lp = CompletionLogProbs()
        offset = start_offset
        for tid, d in zip(comp_ids, positions):
            entry = d.get(tid) if d else None
            tok = token_text(self.text_tokenizer, tid, entry)
            lp.tokens.append(tok)
            lp.token_logprobs.append(clamp_logprob(entry.logprob) if entry is not None else None)
            if d:
                top = {token_text(self.text_tokenizer, t, v): clamp_logprob(v.logprob) for t, v in top_entries(d, k)}
                if entry is not None:
                    top.setdefault(tok, clamp_logprob(entry.logprob))
                lp.top_logprobs.append(top)
            else:
                lp.top_logprobs.append(None)
            lp.text_offset.append(offset)
            offset += len(tok)
        return lp

    def _echo_logprobs(self, ro: Any, prompt_ids: list[int], k: int) -> CompletionLogProbs:
        positions = ro.prompt_logprobs if ro.prompt_logprobs is not None else [None] * len(prompt_ids)
        return self._logprobs(prompt_ids, list(positions), k, 0)

    # ------------------------------------------------------------------ non-streaming
    async def _full(self, req: CompletionRequest, request_id: str, prompts: list, streams: list,
                    prompt_only: bool = False) -> CompletionResponse:
        n = req.n
        choices = [ChoiceState() for _ in range(len(prompts) * n)]
        finals: dict[int, Any] = {}
        cached = [0] * len(prompts)
        kv_transfer_params = None
        merged = merge_streams(streams)
        try:
            async for i, ro in merged:
                cached[i] = max(cached[i], ro.num_cached_tokens or 0)
                kv_transfer_params = ro.kv_transfer_params or kv_transfer_params
                if i not in finals:
                    finals[i] = ro
                if ro.prompt_logprobs is not None:
                    finals[i] = ro
                for comp in ro.outputs:
                    check_finish(comp)
                    self._accumulate(choices[i * n + comp.index], self._visible(comp, prompt_only))
        except Exception as e:
            raise engine_error(self.engine, e, request_id=request_id) from e
        finally:
            await close_all(streams, merged)
        out_choices = []
        for idx, st in enumerate(choices):
            i = idx // n
            text_ids, text = st.token_ids, st.text
            logprobs = None
            prefix = ""
            if req.echo:
                prefix = prompts[i][0] if prompts[i][0] is not None else self.text_tokenizer.decode(prompts[i][1])
            if req.logprobs is not None:
                if req.echo:
                    logprobs = self._echo_logprobs(finals[i], prompts[i][1], req.logprobs)
                    gen = self._logprobs(text_ids, st.logprobs, req.logprobs, len(prefix))
                    logprobs.tokens += gen.tokens
                    logprobs.token_logprobs += gen.token_logprobs
                    logprobs.top_logprobs += gen.top_logprobs
                    logprobs.text_offset += gen.text_offset
                else:
                    logprobs = self._logprobs(text_ids, st.logprobs, req.logprobs, 0)
            out_choices.append(CompletionResponseChoice(
                index=idx, text=prefix + text, logprobs=logprobs, finish_reason=st.finish_reason,
                stop_reason=stop_reason_value(st.stop_reason)))
        usage = make_usage([len(ids) for _, ids in prompts], sum(len(c.token_ids) for c in choices), sum(cached))
        return CompletionResponse(id=request_id, model=self.models.name_for(req.model), choices=out_choices,
                                  usage=usage, kv_transfer_params=kv_transfer_params)

    @staticmethod
    def _accumulate(st: ChoiceState, comp: CompletionOutput) -> None:
        check_finish(comp)
        st.text += comp.text
        st.token_ids.extend(comp.token_ids)
        if comp.logprobs is not None:
            st.logprobs.extend(comp.logprobs)
        if comp.finish_reason is not None:
            st.finish_reason = comp.finish_reason
            st.stop_reason = comp.stop_reason

    # ------------------------------------------------------------------ streaming
    async def _stream(self, req: CompletionRequest, request_id: str, prompts: list, streams: list,
                      prompt_only: bool = False) -> AsyncIterator[str]:
        n = req.n
        created, model = int(time.time()), self.models.name_for(req.model)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        num_choices = len(prompts) * n
        echoed = [not req.echo] * num_choices
        offsets = [0] * num_choices
        num_tokens = [0] * num_choices
        cached = [0] * len(prompts)

        def chunk(idx: int, text: str, logprobs: Any, finish: Optional[str], stop_reason: Any) -> str:
            # The CompletionStreamResponse shape, built as a dict: this is the hot path under load.
            d: dict[str, Any] = {
                "id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": idx, "text": text,
                             "logprobs": logprobs.model_dump(mode="json") if logprobs is not None else None,
                             "finish_reason": finish, "stop_reason": stop_reason_value(stop_reason)}],
            }
            if continuous:
                d["usage"] = make_usage([len(ids) for _, ids in prompts], sum(num_tokens),
                                        sum(cached)).model_dump(mode="json")
            elif include_usage:
                d["usage"] = None
            return sse(d)

        merged = merge_streams(streams)
        try:
            async for i, ro in merged:
                cached[i] = max(cached[i], ro.num_cached_tokens or 0)
                for comp in ro.outputs:
                    check_finish(comp)
                    comp = self._visible(comp, prompt_only)
                    idx = i * n + comp.index
                    text = comp.text
                    logprobs = None
                    if not echoed[idx]:
                        echoed[idx] = True
                        prefix = prompts[i][0] if prompts[i][0] is not None else self.text_tokenizer.decode(prompts[i][1])
                        if req.logprobs is not None:
                            logprobs = self._echo_logprobs(ro, prompts[i][1], req.logprobs)
                        text = prefix + text
                        offsets[idx] = len(prefix)
                    if req.logprobs is not None and comp.logprobs is not None:
                        gen = self._logprobs(comp.token_ids, comp.logprobs, req.logprobs, offsets[idx])
                        if logprobs is None:
                            logprobs = gen
                        else:
                            logprobs.tokens += gen.tokens
                            logprobs.token_logprobs += gen.token_logprobs
                            logprobs.top_logprobs += gen.top_logprobs
                            logprobs.text_offset += gen.text_offset
                    offsets[idx] += len(comp.text)
                    num_tokens[idx] += len(comp.token_ids)
                    # One chunk per engine step that produced tokens (even if their text is held
                    # back), so clients can time tokens; nothing when nothing happened.
                    if not text and not comp.token_ids and comp.finish_reason is None and logprobs is None:
                        continue
                    yield chunk(idx, text, logprobs, comp.finish_reason, comp.stop_reason)
            if include_usage:
                usage = make_usage([len(ids) for _, ids in prompts], sum(num_tokens), sum(cached))
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": model, "choices": [], "usage": usage.model_dump(mode="json")})
        except APIError as e:
            yield sse_error(e)
        except Exception as e:
            yield sse_error(engine_error(self.engine, e, request_id=request_id))
        finally:
            await close_all(streams, merged)
        yield SSE_DONE
