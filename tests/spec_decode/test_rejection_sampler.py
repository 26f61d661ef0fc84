"""The rejection sampler's output is exactly the target's distribution, every sampling parameter applied.

A tiny vocabulary (6 tokens), fixed target logits for the 1 + k rows, and many requests in one batch
(one shared generator: the draws are i.i.d.).  The first emitted token must follow p_0; the second,
given the first was the accepted draft x, must follow p_1 computed with x in the output (penalties see
it); the bonus token after all drafts must follow p_k.  p_j is the plain Sampler's distribution
(adjusted_logits -> sampling_probs), so speculation on and off sample the same thing.  Both one-hot
drafts (prompt lookup) and drafts drawn from a random q (a draft model) are tested; each frequency
table passes a chi-square test at p = 1e-4 (df = vocabulary - 1)."""

from __future__ import annotations

import math

import pytest
import torch

from roofline.core.scheduler_output import SamplingSpec
from roofline.model_executor.layers.sampler import SamplingState, adjusted_logits, sampling_probs
from roofline.spec_decode.rejection_sampler import RejectionSampler, position_states
from tests.reference.sampling_specs import spec

V = 6
N = 30000
PROMPT = [3]
OUTPUT = [1, 1, 2]


PARAMS = {
    "plain": spec(),
    "temperature_top_k": spec(temperature=0.7, top_k=4),
    "top_p_min_p": spec(temperature=1.3, top_p=0.8, min_p=0.05),
    "penalties": spec(temperature=0.9, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.4),
    "min_tokens": spec(min_tokens=len(OUTPUT) + 1, stop_token_ids=[5]),  # row 0 suppresses token 5, row 1 not
}


def target_probs(logits: torch.Tensor, s: SamplingSpec, output: list[int]) -> torch.Tensor:
    st = SamplingState(s, torch.Generator(), PROMPT, list(output))
    return sampling_probs(adjusted_logits(logits[None], [st]), [s])[0]


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    keep = probs > 0
    assert counts[~keep].sum() == 0, f"tokens of probability 0 were emitted: {counts.tolist()}"
    exp = probs[keep] * n
    stat = ((counts[keep] - exp) ** 2 / exp).sum().item()
    df = int(keep.sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def run_batch(logits_rows, s, drafts_per_req, q):
    gen = torch.Generator().manual_seed(1234)
    n = len(drafts_per_req)
    states = [SamplingState(s, gen, PROMPT, list(OUTPUT)) for _ in range(n)]
    logits = logits_rows.repeat(n, 1)
    probs = [q[: len(d)] for d in drafts_per_req] if q is not None else None
    tokens, _ = RejectionSampler()(logits, states, drafts_per_req, probs)
    return tokens


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("drafts_from", ["one_hot", "random_q"])
def test_emitted_tokens_follow_the_target(name, drafts_from):
    s = PARAMS[name]
    g = torch.Generator().manual_seed(7)
    k = 2
    logits_rows = torch.randn(k + 1, V, generator=g) * 1.5
    if drafts_from == "one_hot":
        q = None
        p0 = target_probs(logits_rows[0], s, OUTPUT)
        d0 = int(p0.argmax())  # a likely draft, so that the second position is reached often
        p1 = target_probs(logits_rows[1], s, OUTPUT + [d0])
        drafts = [[d0, int(p1.argmax())]] * N
    else:
        q = torch.softmax(torch.randn(k, V, generator=g), dim=-1)
        draws = torch.multinomial(q, N, replacement=True, generator=g).T  # [N x k], row i ~ q_0, q_1
        drafts = draws.tolist()
    tokens = run_batch(logits_rows, s, drafts, q)

    p0 = target_probs(logits_rows[0], s, OUTPUT)
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=V).double()
    assert chi2_pvalue(first, p0.double()) > 1e-4, (first / N, p0)

    # the second emitted token, given the first was the accepted draft x (most frequent x)
    two = [(d, t) for d, t in zip(drafts, tokens) if len(t) >= 2]
    assert len(two) > N // 20
    xs = torch.bincount(torch.tensor([t[0] for _, t in two]), minlength=V)
    x = int(xs.argmax())
    seconds = torch.tensor([t[1] for _, t in two if t[0] == x])
    p1 = target_probs(logits_rows[1], s, OUTPUT + [x])
    assert chi2_pvalue(torch.bincount(seconds, minlength=V).double(), p1.double()) > 1e-4

    # the bonus token after both drafts (y, z) were accepted
    three = [t for t in tokens if len(t) == 3]
    if drafts_from == "one_hot":
        assert len(three) > 1000
    if len(three) > 1000:
        y, z = max({(t[0], t[1]) for t in three}, key=lambda yz: sum(1 for t in three if t[:2] == list(yz)))
        bonus = torch.tensor([t[2] for t in three if t[0] == y and t[1] == z])
        p2 = target_probs(logits_rows[2], s, OUTPUT + [y, z])
        assert chi2_pvalue(torch.bincount(bonus, minlength=V).double(), p2.double()) > 1e-4


def test_greedy_accepts_while_equal_to_argmax_with_penalties():
    s = spec(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.3)
    g = torch.Generator().manual_seed(3)
    logits_rows = torch.randn(4, V, generator=g)
    # the target's greedy tokens, row by row, each with the previous ones in its output
    out, want = list(OUTPUT), []
    for j in range(4):
        st = SamplingState(s, g, PROMPT, list(out))
        t = int(adjusted_logits(logits_rows[j][None], [st]).argmax())
        want.append(t)
        out.append(t)
    wrong = (want[2] + 1) % V
    (all_right, third_wrong), _ = RejectionSampler()(logits_rows.repeat(2, 1)[:7], [
        SamplingState(s, g, PROMPT, list(OUTPUT)), SamplingState(s, g, PROMPT, list(OUTPUT))],
        [want[:3], [want[0], want[1]]][:1] + [[want[0], want[1], wrong][:2]])
    assert all_right == want  # three accepted + the bonus
    assert third_wrong == want[:3]


def test_seeded_requests_reproduce_and_logprobs_are_the_targets():
    s = spec(temperature=0.8, top_p=0.9, logprobs=2)
    logits_rows = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    results = []
    for _ in range(2):
        st = SamplingState(s, torch.Generator().manual_seed(99), PROMPT, list(OUTPUT))
        results.append(RejectionSampler()(logits_rows, [st], [[0, 1]]))
    assert results[0][0] == results[1][0]
    tokens, lps = results[0]
    raw = logits_rows.log_softmax(-1)
    for j, (tok, lp) in enumerate(zip(tokens[0], lps[0])):
        assert lp.token_ids[0] == tok and math.isclose(lp.logprobs[0], raw[j, tok].item(), rel_tol=1e-6)
        assert lp.token_ids[1:] == raw[j].topk(2).indices.tolist()


def test_position_states_see_earlier_drafts():
    st = SamplingState(spec(), torch.Generator(), PROMPT, [1])
    rows = position_states(st, [7, 8])
    assert [r.output_token_ids for r in rows] == [[1], [1, 7], [1, 7, 8]]
    assert st.output_token_ids == [1]


def test_a_seeded_request_emits_the_same_tokens_alone_and_in_any_batch():
    """The batched verification keeps each request's own generator in its order (its uniforms, then its
    draw): a seeded request's tokens do not depend on the requests verified beside it."""
    g = torch.Generator().manual_seed(3)
    specs = [PARAMS["plain"], PARAMS["temperature_top_k"], PARAMS["top_p_min_p"], PARAMS["penalties"]]
    for trial in range(40):
        drafts = [torch.randint(0, V, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(5)]
        qs = [torch.softmax(torch.randn(len(d), V, generator=g), -1) if d and r % 2 else None
              for r, d in enumerate(drafts)]
        logits = torch.randn(sum(len(d) + 1 for d in drafts), V, generator=g) * 2
        sp = [specs[(trial + r) % len(specs)] for r in range(5)]

        def verify(which):
            states = [SamplingState(sp[r], torch.Generator().manual_seed(100 * trial + r), PROMPT, list(OUTPUT))
                      for r in which]
            starts = [sum(len(d) + 1 for d in drafts[:r]) for r in range(5)]
            rows = torch.cat([logits[starts[r]: starts[r] + len(drafts[r]) + 1] for r in which])
            return RejectionSampler()(rows, states, [drafts[r] for r in which], [qs[r] for r in which])[0]

        together = verify(range(5))
        for r in range(5):
            assert verify([r]) == [together[r]], (trial, r)
