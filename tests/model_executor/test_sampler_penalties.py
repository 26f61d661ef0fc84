"""The batched penalties (sampler._apply_penalties) equal a row-at-a-time application bit for bit."""

from __future__ import annotations

import random

import torch

from roofline.model_executor.layers.sampler import SamplingState, _apply_penalties
from tests.reference.sampling_specs import spec


def one_row_at_a_time(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """The penalties' definition, one row and one torch op at a time (HF's repetition penalty: a seen
    token's logit divided by the penalty when positive, multiplied when not; OpenAI's frequency and presence
    penalties on the output's tokens)."""
    for i, st in enumerate(states):
        s, row = st.spec, logits[i]
        if s.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(st.prompt_token_ids) | set(st.output_token_ids)))
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty)
        if st.output_token_ids and (s.presence_penalty or s.frequency_penalty):
            ids, counts = torch.tensor(st.output_token_ids).unique(return_counts=True)
            row[ids] -= s.frequency_penalty * counts.to(row.dtype) + s.presence_penalty


def test_batched_penalties_equal_one_row_at_a_time():
    rng = random.Random(0)
    vocab = 50
    states = []
    for _ in range(64):
        s = spec(repetition_penalty=rng.choice([1.0, 1.3, 0.77, 2.1]),
                 presence_penalty=rng.choice([0.0, 0.5, -1.1, 1.7]),
                 frequency_penalty=rng.choice([0.0, 0.4, -0.3, 0.123456789]))
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        states.append(SamplingState(s, torch.Generator(), prompt, output))
    logits = torch.randn(len(states), vocab, generator=torch.Generator().manual_seed(1)) * 3
    want = logits.clone()
    one_row_at_a_time(want, states)
    got = logits.clone()
    _apply_penalties(got, states)
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)  # the penalties did something
