"""LLM: the offline API, vLLM-compatible (`from roofline import LLM, SamplingParams`).

Its defaults lean to throughput, as the server's lean to latency: `generate` returns each output once the
whole batch is done, so no stream's inter-token latency is there to protect, and the ITL-driven token budget
(core/step_budget.py) is off unless `target_itl_ms` is given -- every step takes up to max_num_batched_tokens
of prefill beside its decodes.  With the budget, a burst of prompts is admitted a few chunks a step so that
each step stays near a decode step of the full batch, and the decode batch grows slowly: W1 on a small
gpt-oss-shaped MoE model (2-core Zen 3) took 256.5 s with it, 120.1 s without (the default model's and a
Gemma-3-1B-shaped model's W1: the same within noise).  The engine itself (EngineCore, the server) keeps the
budget on by default.

LoRA adapters: `LLM(model, enable_lora=True, max_loras=..., max_lora_rank=...)`, then
`generate(prompts, params, lora_request=LoRARequest(name, id, path))` -- one for every prompt, or a list
with one (or None: the base model) per prompt.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

from tqdm import tqdm

from roofline.config import EngineArgs
from roofline.engine.chat_template import format_content, load_chat_template, resolve_content_format
from roofline.engine.engine_core import EngineCore
from roofline.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from roofline.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

PromptType = Union[str, dict]


class LLM:
    def __init__(self, model: Optional[str] = None, **engine_args) -> None:
        show_progress = engine_args.pop("show_progress", True)
        if engine_args.get("target_itl_ms") is None:  # offline: the ITL budget off unless a target is given
            engine_args["target_itl_ms"] = 0
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.llm_engine = EngineCore.from_engine_args(args, show_progress=show_progress)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def _to_token_ids(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            tok = self.llm_engine.tokenizer
            if tok is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]} prompts")
            return prompt, tok.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._to_token_ids(prompt["prompt"])
        raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(lora_request, (list, tuple)):
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts")
        else:
            loras = [lora_request] * len(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        # Validate everything before anything is scheduled.
        engine = self.llm_engine
        staged = []
        for i, (prompt, params, lora) in enumerate(zip(prompts, params_list, loras)):
            text, ids = self._to_token_ids(prompt)
            try:
                engine.validate(ids, params, lora)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            p = params.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY
            staged.append((text, ids, p, lora))
        order = {}
        for i, (text, ids, p, lora) in enumerate(staged):
            rid = f"llm-{next(self._counter)}"
            order[rid] = i
            engine.add_request(rid, ids, p, prompt=text, priority=priority[i] if priority else 0, lora_request=lora)
        results: list[Optional[RequestOutput]] = [None] * len(staged)
        bar = tqdm(total=len(staged), desc="Processed prompts", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            engine.abort_requests([rid for rid, i in order.items() if results[i] is None])
            engine.step()
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def beam_search(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request=None,
    ) -> list[BeamSearchOutput]:
        """Beam search on each prompt, all in one batch (each prompt is one engine request: see
        EngineCore); raises RuntimeError when a prompt's search failed in the engine."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        outs = self.generate(prompts, params.sampling_params(), use_tqdm=use_tqdm, lora_request=lora_request)
        results = []
        for i, out in enumerate(outs):
            if out.error:
                raise RuntimeError(f"prompt {i}: {out.error}")
            results.append(BeamSearchOutput([
                BeamSearchSequence(tokens=out.prompt_token_ids + c.token_ids, text=c.text,
                                   cum_logprob=c.cumulative_logprob, score=c.score, finish_reason=c.finish_reason)
                for c in out.outputs]))
        return results

    def chat(
        self,
        messages: Union[list[dict], list[list[dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        chat_template_content_format: str = "auto",
        chat_template_kwargs: Optional[dict] = None,
        continue_final_message: bool = False,
        tools: Optional[list[dict]] = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template (or chat_template: a Jinja file's path or
        the template itself) and generate.  Message content may be a string or a list of text parts."""
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        template = load_chat_template(chat_template)
        fmt = resolve_content_format(chat_template_content_format, template or getattr(tok, "chat_template", None))
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            conv = [{**m, "content": format_content(m.get("content"), fmt)} for m in conv]
            text = tok.apply_chat_template(conv, tokenize=False, chat_template=template, tools=tools,
                                           add_generation_prompt=add_generation_prompt and not continue_final_message,
                                           continue_final_message=continue_final_message,
                                           **(chat_template_kwargs or {}))
            ids = tok.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
