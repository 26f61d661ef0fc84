"""GpuSampler (batched, one upload and one download per step) against Sampler, the reference: the same
greedy tokens, the same seeded samples (each request's generator consumed identically), the same
penalties, min_tokens stop suppression, and logprobs -- compared exactly, on CPU."""

from __future__ import annotations

import random

import pytest
import torch

from roofline.model_executor.layers import gpu_sampler
from roofline.model_executor.layers.gpu_sampler import GpuSampler
from roofline.model_executor.layers.sampler import Sampler, SamplingState, prompt_logprobs_rows
from tests.reference.sampling_specs import spec

VOCAB = 97


def states_pair(specs, seed=0, rng=None):
    """Two lists of equal states (own generators seeded alike) for the two samplers."""
    rng = rng or random.Random(seed)
    out_a, out_b = [], []
    for j, s in enumerate(specs):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
        for out in (out_a, out_b):
            gen = torch.Generator().manual_seed(1000 + seed * 31 + j)
            out.append(SamplingState(spec=s, generator=gen, prompt_token_ids=list(prompt),
                                     output_token_ids=list(output)))
    return out_a, out_b


def assert_same(a, b):
    ta, la = a
    tb, lb = b
    assert ta == tb
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert x.token_ids == y.token_ids and x.ranks == y.ranks and x.logprobs == y.logprobs


def run_both(specs, seed=0, steps=1, logits_scale=3.0):
    """Several steps (outputs appended as the ModelRunner does) so generators advance alike."""
    g = torch.Generator().manual_seed(seed)
    sa, sb = states_pair(specs, seed)
    ref, new = Sampler(), GpuSampler()
    for _ in range(steps):
        logits = torch.randn(len(specs), VOCAB, generator=g) * logits_scale
        a = ref(logits.clone(), sa)
        b = new(logits.clone(), sb)
        assert_same(a, b)
        for st, t in zip(sa, a[0]):
            st.output_token_ids.append(t)
        for st, t in zip(sb, b[0]):
            st.output_token_ids.append(t)
    return a


def test_greedy_rows():
    run_both([spec(temperature=0.0) for _ in range(5)], seed=1, steps=3)


def test_seeded_random_rows_all_filters():
    specs = [
        spec(temperature=0.8),
        spec(temperature=1.3, top_k=5),
        spec(temperature=0.7, top_p=0.9),
        spec(temperature=1.0, min_p=0.05),
        spec(temperature=0.9, top_k=20, top_p=0.8, min_p=0.02),
        spec(temperature=0.0),  # greedy row in the middle: consumes no randomness
        spec(temperature=1.1, top_k=VOCAB + 5),  # top-k beyond the vocab = off
    ]
    run_both(specs, seed=2, steps=4)


def test_penalties_and_min_tokens():
    specs = [
        spec(temperature=0.0, repetition_penalty=1.3),
        spec(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4),
        spec(temperature=0.8, repetition_penalty=0.8, frequency_penalty=-0.3, top_p=0.95),
        spec(temperature=0.0, min_tokens=50, stop_token_ids=[0, 1, 2, 3, 5, 8]),
        spec(temperature=1.0, min_tokens=3, stop_token_ids=[4], presence_penalty=1.5),
        spec(temperature=0.0),
    ]
    run_both(specs, seed=3, steps=5, logits_scale=1.0)


def test_min_tokens_actually_suppresses():
    specs = [spec(temperature=0.0, min_tokens=10, stop_token_ids=list(range(VOCAB - 1)))]
    tokens, _ = run_both(specs, seed=4)
    assert tokens == [VOCAB - 1]


def test_logprobs_mixed_k():
    specs = [
        spec(temperature=0.0, logprobs=0),
        spec(temperature=0.0),
        spec(temperature=0.9, logprobs=3, seed=7),
        spec(temperature=0.0, logprobs=5, repetition_penalty=1.2),
        spec(temperature=1.2, top_k=10),
    ]
    run_both(specs, seed=5, steps=3)


def test_logprobs_every_row():
    run_both([spec(temperature=0.5, logprobs=2) for _ in range(4)], seed=6, steps=2)


def test_random_mixture():
    rng = random.Random(9)
    specs = []
    for _ in range(24):
        specs.append(spec(
            temperature=rng.choice([0.0, 0.0, 0.6, 1.0, 1.4]),
            top_k=rng.choice([0, 0, 3, 40]),
            top_p=rng.choice([1.0, 1.0, 0.5, 0.92]),
            min_p=rng.choice([0.0, 0.0, 0.1]),
            repetition_penalty=rng.choice([1.0, 1.0, 1.15]),
            presence_penalty=rng.choice([0.0, 0.3]),
            frequency_penalty=rng.choice([0.0, 0.2]),
            min_tokens=rng.choice([0, 0, 4]),
            stop_token_ids=rng.choice([[], [1, 2]]),
            logprobs=rng.choice([None, None, 0, 4]),
        ))  # fmt: skip
    run_both(specs, seed=9, steps=3)


def test_empty_batch():
    assert GpuSampler()(torch.zeros(0, VOCAB), []) == ([], [])


@pytest.mark.parametrize("k", [0, 4])
def test_prompt_logprobs_rows(k):
    g = torch.Generator().manual_seed(10 + k)
    logits = torch.randn(6, VOCAB, generator=g) * 2
    nxt = [3, 50, 96, 0, 7, 7]
    a = prompt_logprobs_rows(logits, nxt, k)
    b = gpu_sampler.prompt_logprobs_rows(logits, nxt, k)
    assert_same((nxt, a), (nxt, b))
    assert gpu_sampler.prompt_logprobs_rows(logits, [], k) == []


@pytest.mark.parametrize("sampler", [Sampler, GpuSampler])
def test_a_row_that_allows_nothing_gets_no_token(sampler):
    """Every logit -inf (a grammar dead end, or min_tokens suppressing the only allowed stop token) or a
    NaN best logit: the row gets NO_TOKEN (never an id outside the vocabulary, never an arbitrary one),
    greedy or random, and the other rows keep their tokens and logprobs (same as without the dead rows)."""
    from roofline.model_executor.layers.sampler import NO_TOKEN

    specs = [spec(temperature=0.0, logprobs=2), spec(temperature=0.0), spec(temperature=0.9, seed=3, logprobs=1),
             spec(temperature=0.0, min_tokens=50, stop_token_ids=[7]), spec(temperature=0.8, top_p=0.9),
             spec(temperature=1.0, logprobs=3)]
    logits = torch.randn(len(specs), VOCAB, generator=torch.Generator().manual_seed(11)) * 3
    logits[1] = float("-inf")
    logits[2] = float("-inf")
    logits[3] = float("-inf")
    logits[3, 7] = 5.0  # only the stop token is allowed, and min_tokens holds it back
    logits[4, 13] = float("nan")
    live = [0, 5]
    sa, sb = states_pair(specs, seed=12)
    tokens, lps = sampler()(logits.clone(), sa)
    assert [tokens[i] for i in (1, 2, 3, 4)] == [NO_TOKEN] * 4
    assert all(lps[i] is None for i in (1, 2, 3, 4))
    assert all(0 <= tokens[i] < VOCAB for i in live)
    ref_tokens, ref_lps = sampler()(logits[live].clone(), [sb[i] for i in live])
    assert [tokens[i] for i in live] == ref_tokens
    assert [lps[i] for i in live] == ref_lps


def test_draw_rows_stays_in_the_vocabulary():
    from roofline.model_executor.layers.sampler import draw_rows

    probs = torch.zeros(3, VOCAB)
    probs[0, 5] = 1.0
    probs[2] = float("nan")  # a row with no positive finite sum would search past the end
    drawn = draw_rows(probs, [torch.Generator().manual_seed(i) for i in range(3)]).tolist()
    assert drawn[0] == 5 and all(0 <= t < VOCAB for t in drawn)
