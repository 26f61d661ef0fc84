"""Sampling parameters, stop conditions, n>1, logprobs, detokenization and bad input, on the
default model (SmolLM2) loaded once per session."""

from __future__ import annotations

import pytest
import torch

from roofline import SamplingParams
from roofline.engine.output_processor import IncrementalDetokenizer
from roofline.sampling_params import RequestOutputKind

PROMPT = "Tell me a short story about a dragon who learns to bake bread."


def chat_ids(llm, text):
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)


def gen(llm, ids, **kw):
    return llm.generate({"prompt_token_ids": ids}, SamplingParams(**kw), use_tqdm=False)[0]


def test_seed_reproducible_whoever_shares_the_batch(default_llm):
    ids = chat_ids(default_llm, PROMPT)
    alone = gen(default_llm, ids, temperature=1.0, seed=1234, max_tokens=24)
    others = [{"prompt_token_ids": chat_ids(default_llm, f"Question {i}: name a fruit.")} for i in range(5)]
    batch = default_llm.generate(
        others[:2] + [{"prompt_token_ids": ids}] + others[2:],
        [SamplingParams(temperature=0.9, max_tokens=30)] * 2 + [SamplingParams(temperature=1.0, seed=1234, max_tokens=24)]
        + [SamplingParams(temperature=1.1, seed=7, max_tokens=20)] * 3,
        use_tqdm=False,
    )
    assert batch[2].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = gen(default_llm, ids, temperature=1.0, seed=4321, max_tokens=24)
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_top_k_1_is_greedy_and_filters_run(default_llm):
    ids = chat_ids(default_llm, PROMPT)
    greedy = gen(default_llm, ids, temperature=0, max_tokens=16).outputs[0].token_ids
    assert gen(default_llm, ids, temperature=0.8, top_k=1, seed=0, max_tokens=16).outputs[0].token_ids == greedy
    # a vanishing top_p keeps only the most likely token
    assert gen(default_llm, ids, temperature=1.0, top_p=1e-6, seed=3, max_tokens=16).outputs[0].token_ids == greedy
    assert gen(default_llm, ids, temperature=1.0, min_p=0.999, seed=3, max_tokens=16).outputs[0].token_ids == greedy


def test_stop_string_across_token_boundary(default_llm):
    ids = chat_ids(default_llm, PROMPT)
    full = gen(default_llm, ids, temperature=0, max_tokens=40, ignore_eos=True).outputs[0]
    text = full.text
    stop = text[21:27]  # a 6-character slice, generally spanning tokens
    assert stop and stop.strip()
    out = gen(default_llm, ids, temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]).outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    inc = gen(default_llm, ids, temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
              include_stop_str_in_output=True).outputs[0]
    assert inc.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_max_tokens_min_tokens_eos(default_llm):
    llm = default_llm
    ids = chat_ids(llm, "What is the capital of France?")
    natural = gen(llm, ids, temperature=0, max_tokens=40).outputs[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] == llm.get_tokenizer().eos_token_id
    assert "<|im_end|>" not in natural.text
    longer = gen(llm, ids, temperature=0, max_tokens=40, min_tokens=len(natural.token_ids) + 5).outputs[0]
    assert len(longer.token_ids) >= len(natural.token_ids) + 5
    assert longer.token_ids[: len(natural.token_ids) - 1] == natural.token_ids[:-1]
    stop_tok = natural.token_ids[3]
    st = gen(llm, ids, temperature=0, max_tokens=40, stop_token_ids=[stop_tok]).outputs[0]
    assert st.token_ids == natural.token_ids[:4] and st.finish_reason == "stop" and st.stop_reason == stop_tok
    length = gen(llm, ids, temperature=0, max_tokens=3).outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3
    ign = gen(llm, ids, temperature=0, max_tokens=len(natural.token_ids) + 4, ignore_eos=True).outputs[0]
    assert len(ign.token_ids) == len(natural.token_ids) + 4


def test_repetition_penalty_matches_hf(default_llm, hf_default_model):
    ids = chat_ids(default_llm, "List the numbers from one to twenty in words.")
    ours = gen(default_llm, ids, temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3).outputs[0]
    t = torch.tensor([ids])
    ref = hf_default_model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=24, min_new_tokens=24,
                                    do_sample=False, repetition_penalty=1.3, pad_token_id=0)[0, len(ids):].tolist()
    assert ours.token_ids == ref
    plain = gen(default_llm, ids, temperature=0, max_tokens=24, ignore_eos=True).outputs[0]
    assert plain.token_ids != ours.token_ids


def test_presence_and_frequency_penalties_reduce_repeats(default_llm):
    ids = chat_ids(default_llm, "Repeat the word 'cat' many times.")
    plain = gen(default_llm, ids, temperature=0, max_tokens=30, ignore_eos=True).outputs[0].token_ids
    pen = gen(default_llm, ids, temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=2.0,
              presence_penalty=2.0).outputs[0].token_ids
    assert len(set(pen)) > len(set(plain))


def test_n_completions_share_prompt(default_llm):
    ids = chat_ids(default_llm, PROMPT)
    greedy = gen(default_llm, ids, temperature=0, max_tokens=12).outputs[0].token_ids
    two = gen(default_llm, ids, temperature=0, max_tokens=12, n=2)
    assert [c.index for c in two.outputs] == [0, 1]
    assert all(c.token_ids == greedy for c in two.outputs)
    sampled = gen(default_llm, ids, temperature=1.2, max_tokens=16, n=3, seed=5)
    assert len(sampled.outputs) == 3
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    stats = default_llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_logprobs_cumulative_and_ranks(default_llm):
    ids = chat_ids(default_llm, PROMPT)
    out = gen(default_llm, ids, temperature=0, max_tokens=8, logprobs=3).outputs[0]
    assert len(out.logprobs) == 8
    total = 0.0
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp[tok].rank == 1  # greedy picks the top token
        assert len(lp) == 3
        total += lp[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_delta_outputs_concatenate_to_final_text(default_llm):
    engine = default_llm.llm_engine
    ids = chat_ids(default_llm, PROMPT)
    full = gen(default_llm, ids, temperature=0, max_tokens=30, ignore_eos=True).outputs[0]
    stop = full.text[15:19]
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    p.output_kind = RequestOutputKind.DELTA
    engine.add_request("delta-1", ids, p)
    pieces, toks = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            pieces.append(o.outputs[0].text if o.outputs else "")
            toks.extend(o.outputs[0].token_ids if o.outputs else [])
    assert "".join(pieces) == full.text[: full.text.index(stop)]


def test_incremental_detokenizer_multibyte(default_llm):
    tok = default_llm.get_tokenizer()
    text = "Caf\u00e9 na\u00efve \u4e16\u754c \U0001F642 \u00fcber \u0444\u043e\u0442\u043e!"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = [detok.add([t]) for t in ids]
    pieces.append(detok.add([], final=True))
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize(
    "make",
    [
        lambda ids: ([], SamplingParams(max_tokens=4)),
        lambda ids: (ids + [10**6], SamplingParams(max_tokens=4)),
        lambda ids: ([-1] + ids, SamplingParams(max_tokens=4)),
        lambda ids: (ids * 400, SamplingParams(max_tokens=4)),
        lambda ids: (ids, SamplingParams(max_tokens=8192)),
    ],
    ids=["empty", "token-too-large", "negative-token", "prompt-too-long", "max-tokens-too-large"],
)
def test_bad_input_raises_before_scheduling(default_llm, make):
    ids = chat_ids(default_llm, "Hi")
    bad_ids, params = make(ids)
    good = {"prompt_token_ids": ids}
    before = default_llm.llm_engine.get_stats()
    with pytest.raises(ValueError) as e:
        default_llm.generate([good, {"prompt_token_ids": bad_ids}], [SamplingParams(max_tokens=4), params],
                             use_tqdm=False)
    assert "prompt 1" in str(e.value)
    assert not default_llm.llm_engine.has_unfinished_requests()
    after = default_llm.llm_engine.get_stats()
    assert after.num_free_blocks == after.num_total_blocks == before.num_total_blocks
    # still serving
    assert gen(default_llm, ids, temperature=0, max_tokens=3).outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2),
           dict(n=0), dict(max_tokens=0), dict(presence_penalty=3), dict(repetition_penalty=0),
           dict(min_tokens=5, max_tokens=2), dict(logprobs=-1), dict(stop=[""])],
)
def test_invalid_sampling_params_name_the_field(kw):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert next(iter(kw)) in str(e.value)


def test_failing_request_does_not_disturb_others(default_llm):
    engine = default_llm.llm_engine
    ids = chat_ids(default_llm, PROMPT)
    ref = gen(default_llm, ids, temperature=0, max_tokens=10).outputs[0].token_ids
    engine.add_request("ok-1", ids, SamplingParams(temperature=0, max_tokens=10))
    with pytest.raises(ValueError):
        engine.add_request("bad-1", [], SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request("ok-1", ids, SamplingParams())  # duplicate id
    engine.add_request("abort-me", ids, SamplingParams(temperature=0, max_tokens=50))
    finals = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
        steps += 1
        if steps == 3:
            engine.abort_requests(["abort-me"])
    assert finals["ok-1"].outputs[0].token_ids == ref
    assert finals["abort-me"].outputs[0].finish_reason == "abort"
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
