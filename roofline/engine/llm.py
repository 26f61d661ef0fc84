"""LLM: the offline API, vLLM-compatible (`from roofline import LLM, SamplingParams`)."""

from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

from tqdm import tqdm

from roofline.config import EngineArgs
from roofline.engine.engine_core import EngineCore
from roofline.outputs import RequestOutput
from roofline.sampling_params import RequestOutputKind, SamplingParams

PromptType = Union[str, dict]


class LLM:
    def __init__(self, model: Optional[str] = None, **engine_args) -> None:
        show_progress = engine_args.pop("show_progress", True)
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
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
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
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            text, ids = self._to_token_ids(prompt)
            try:
                engine.validate(ids, params)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            p = params.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY
            staged.append((text, ids, p))
        order = {}
        for i, (text, ids, p) in enumerate(staged):
            rid = f"llm-{next(self._counter)}"
            order[rid] = i
            engine.add_request(rid, ids, p, prompt=text, priority=priority[i] if priority else 0)
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

    def chat(
        self,
        messages: Union[list[dict], list[list[dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
    ) -> list[RequestOutput]:
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template)
            ids = tok.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
