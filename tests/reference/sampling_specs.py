"""SamplingSpec for sampler tests: the plain sampler's defaults (temperature 1, no filter, no penalty) with
the given fields changed."""

from __future__ import annotations

from roofline.core.scheduler_output import SamplingSpec


def spec(**kw) -> SamplingSpec:
    base = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                frequency_penalty=0.0, seed=None, min_tokens=0, stop_token_ids=[], logprobs=None,
                prompt_logprobs=None)
    base.update(kw)
    return SamplingSpec(**base)
