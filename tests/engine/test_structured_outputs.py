"""Structured outputs end to end on the real default model: outputs parse and validate against their
JSON schema (hypothesis over simple schemas and prompts, greedy and seeded random sampling), regex /
choice / grammar outputs match, a request whose constraint does not compile fails alone with its
error, unconstrained requests in the same batch are unchanged bit for bit, constrained rows never take
the greedy LM-head shortcut, and chunked prefill + preemption + n > 1 keep every output valid.  Every
KV block returns to the pool."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roofline import LLM, SamplingParams
from roofline.sampling_params import StructuredOutputsParams

QUESTIONS = ["Describe a user of a web shop.", "Give me some data about a cat.", "Reply in JSON.",
             "What is the weather like?", "List facts about Paris."]


def chat_prompt(llm, question: str) -> dict:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def validate(value, schema: dict) -> None:
    """The JSON-schema subset the strategies below generate (strict: no undeclared properties)."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
    t = schema.get("type")
    if t == "object":
        assert isinstance(value, dict), value
        props = schema.get("properties", {})
        assert set(schema.get("required", [])) <= set(value) <= set(props), (value, schema)
        for k, v in value.items():
            validate(v, props[k])
    elif t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), (value, schema)
    elif t == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)), (value, schema)
    elif t == "boolean":
        assert isinstance(value, bool), value
    elif t == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)), (value, schema)
        for v in value:
            validate(v, schema["items"])


def assert_all_blocks_back(llm) -> None:
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


LEAF = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 200)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
    st.lists(st.sampled_from(["red", "green", "blue", "cyan"]), min_size=1, max_size=3, unique=True)
    .map(lambda e: {"type": "string", "enum": e}),
    st.builds(lambda n: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": n},
              st.integers(0, 3)),
)
SCHEMAS = st.dictionaries(st.sampled_from(["name", "age", "ok", "tags", "color", "id"]), LEAF, min_size=1,
                          max_size=3).map(lambda props: {"type": "object", "properties": props,
                                                         "required": sorted(props)})


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SCHEMAS, questions=st.lists(st.sampled_from(QUESTIONS), min_size=1, max_size=2),
       seed=st.integers(0, 2**20))
def test_json_schema_outputs_validate(default_llm, schema, questions, seed):
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0, max_tokens=100, structured_outputs=so),
              SamplingParams(temperature=1.0, seed=seed, max_tokens=100, structured_outputs=so)]
    prompts = [chat_prompt(default_llm, q) for q in questions for _ in params]
    outs = default_llm.generate(prompts, params * len(questions), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert o.error is None and c.finish_reason == "stop", (c.text, c.finish_reason)
        validate(json.loads(c.text), schema)
    assert_all_blocks_back(default_llm)


def test_regex_choice_grammar_json_object_and_n(default_llm):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"]}
    regex = r"[A-Z][a-z]{2,6} [0-9]{1,3}"
    cases = [
        (StructuredOutputsParams(regex=regex), dict(temperature=0), lambda t: re.fullmatch(regex, t)),
        (StructuredOutputsParams(regex=regex), dict(temperature=1.0, seed=5), lambda t: re.fullmatch(regex, t)),
        (StructuredOutputsParams(choice=["sunny", "rainy", "windy day"]), dict(temperature=0.9, seed=2),
         lambda t: t in ("sunny", "rainy", "windy day")),
        (StructuredOutputsParams(grammar='root ::= "temp=" [0-9] [0-9]? "C"'), dict(temperature=0),
         lambda t: re.fullmatch(r"temp=[0-9][0-9]?C", t)),
        (StructuredOutputsParams(json_object=True), dict(temperature=0), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputsParams(json=schema), dict(temperature=0.8, seed=11, n=3),
         lambda t: validate(json.loads(t), schema) is None),
    ]
    prompt = chat_prompt(default_llm, "What is the weather like in a big city?")
    params = [SamplingParams(max_tokens=120, structured_outputs=so, **kw) for so, _, kw in
              [(c[0], None, c[1]) for c in cases]]
    outs = default_llm.generate([prompt] * len(cases), params, use_tqdm=False)
    for (so, _, check), o in zip(cases, outs):
        assert o.error is None
        for c in o.outputs:
            assert c.finish_reason == "stop" and check(c.text), (so.kind, c.text)
    assert len(outs[-1].outputs) == 3
    assert_all_blocks_back(default_llm)


def test_compile_failure_fails_that_request_alone(default_llm):
    prompt = chat_prompt(default_llm, "Count to three.")
    good = SamplingParams(temperature=0, max_tokens=8)
    bad = [SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(ab")),
           SamplingParams(max_tokens=8, n=2, structured_outputs=StructuredOutputsParams(json={"type": "nonsense"}))]
    outs = default_llm.generate([prompt] * 4, [good, bad[0], bad[1], good], use_tqdm=False)
    assert outs[0].error is None and outs[3].error is None and outs[0].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == outs[3].outputs[0].token_ids
    assert re.search(r"structured_outputs\.regex: .*parenthesis", outs[1].error)
    assert re.search(r"structured_outputs\.json: .*nonsense", outs[2].error)
    assert outs[1].finished and outs[2].finished and not outs[1].outputs[0].token_ids
    assert_all_blocks_back(default_llm)


def test_unconstrained_rows_unchanged_bit_for_bit(default_llm):
    free = [SamplingParams(temperature=0, max_tokens=24, logprobs=3),
            SamplingParams(temperature=0, max_tokens=24),
            SamplingParams(temperature=0.9, seed=7, max_tokens=24, logprobs=2)]
    prompts = [chat_prompt(default_llm, q) for q in QUESTIONS[:3]]
    alone = default_llm.generate(prompts, free, use_tqdm=False)
    constrained = [SamplingParams(temperature=t, seed=1, max_tokens=40, structured_outputs=so) for t, so in [
        (0, StructuredOutputsParams(json_object=True)), (0.7, StructuredOutputsParams(regex=r"[a-z]+( [a-z]+)*")),
        (0, StructuredOutputsParams(choice=["alpha", "beta"]))]]
    # compiled once beforehand, so the mixed batch starts together: its decode steps hold 2..8 rows like
    # the free batch's, the row counts whose values the GGUF kernels keep equal (quant_kernels.c)
    default_llm.generate(prompts, constrained, use_tqdm=False)
    mixed = default_llm.generate(prompts + prompts, constrained + free, use_tqdm=False)[3:]
    for a, m in zip(alone, mixed):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
        assert a.outputs[0].logprobs == m.outputs[0].logprobs
        assert a.outputs[0].text == m.outputs[0].text


def test_constrained_rows_skip_the_greedy_head(default_llm, monkeypatch):
    from roofline.cpu import greedy_head

    seen = []
    real = greedy_head.GreedyScreen.tokens

    def counting(self, h, *args, **kw):
        seen.append(h.shape[0])
        return real(self, h, *args, **kw)

    monkeypatch.setattr(greedy_head.GreedyScreen, "tokens", counting)
    prompt = chat_prompt(default_llm, "Name a colour.")
    default_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert seen  # a free greedy row takes the screen on this model ...
    seen.clear()
    so = StructuredOutputsParams(choice=["burgundy red", "teal"])
    out = default_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, structured_outputs=so),
                               use_tqdm=False)
    assert not seen and out[0].outputs[0].text in ("burgundy red", "teal")  # ... a constrained one never


def test_chunked_prefill_and_preemption_keep_outputs_valid(default_llm):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "score"]}
    so = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=so),
              SamplingParams(temperature=0, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(regex="[a-z ]{5,40}\\."))]
    prompts = [chat_prompt(default_llm, q) for q in QUESTIONS[:3]] * 2
    reference = default_llm.generate(prompts, params * 2, use_tqdm=False)
    small = LLM(dtype="float32", device="cpu", num_kv_blocks=8, block_size=16, max_num_batched_tokens=16,
                enable_prefix_caching=False,
                preemption_mode="recompute", max_model_len=512, show_progress=False)
    try:
        outs = small.generate(prompts, params * 2, use_tqdm=False)
        assert small.llm_engine.get_stats().num_preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
        for o in outs[0::3]:
            validate(json.loads(o.outputs[0].text), schema)
        assert_all_blocks_back(small)
    finally:
        small.llm_engine.shutdown()


SELF_REQUIRING = {"$ref": "#", "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


def dead_end_batch(default_llm):
    """Free greedy requests beside constraints that reach a dead end: at compile time (no text matches),
    and at run time (after "aa" nothing can follow; after "ab" only EOS, held back by min_tokens)."""
    prompts = [chat_prompt(default_llm, q) for q in QUESTIONS[:2]]
    free = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0, max_tokens=12, logprobs=2)]
    dead = [StructuredOutputsParams(json=SELF_REQUIRING), StructuredOutputsParams(regex=r"[^\s\S]")]
    late = [SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=r"aa[^\s\S]")),
            SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                           structured_outputs=StructuredOutputsParams(regex=r"aa[^\s\S]")),
            SamplingParams(temperature=0, max_tokens=12, min_tokens=4,
                           structured_outputs=StructuredOutputsParams(regex="ab"))]
    params = free + [SamplingParams(temperature=0, max_tokens=12, structured_outputs=so) for so in dead] + late
    return prompts, free, params


def test_dead_end_constraints_fail_alone(default_llm):
    prompts, free, params = dead_end_batch(default_llm)
    alone = default_llm.generate(prompts, free, use_tqdm=False)
    outs = default_llm.generate(prompts + [prompts[0]] * 5, params, use_tqdm=False)
    for a, o in zip(alone, outs[:2]):
        assert o.error is None and o.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(o.outputs[0].logprobs or [], a.outputs[0].logprobs or []):  # larger prefill: other blocking
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    # a schema whose only content is itself: xgrammar (0.2.9) refuses it as it converts it; a regex no text
    # matches: found when it compiles.  Nothing runs for either.
    assert "invalid structured_outputs.json: Circular $ref" in outs[2].error, outs[2].error
    assert "can never produce a token" in outs[3].error
    for o in outs[2:4]:
        assert o.error_param == "structured_outputs", o.error_param
        assert o.outputs[0].finish_reason == "error" and not o.outputs[0].token_ids
    for o, text in zip(outs[4:], ["aa", "aa", "ab"]):  # found after the last token the grammar allows
        c = o.outputs[0]
        assert "allows no token after" in o.error and o.error_param == "structured_outputs", o.error
        assert c.finish_reason == "error" and c.text == text
        assert all(0 <= t < default_llm.llm_engine.vocab_size for t in c.token_ids)
    assert_all_blocks_back(default_llm)


def test_a_dead_end_the_engine_misses_still_never_samples(default_llm, monkeypatch):
    """The sampler's own guard: with the engine's dead-end check switched off, the all-masked row reaches
    the worker, which fails that request (NO_TOKEN) instead of sampling an id past the vocabulary."""
    from roofline.structured_output.manager import StructuredOutputManager

    monkeypatch.setattr(StructuredOutputManager, "dead_ends", lambda self, requests: [])
    prompts, free, params = dead_end_batch(default_llm)
    alone = default_llm.generate(prompts, free, use_tqdm=False)
    outs = default_llm.generate(prompts + [prompts[0]] * 3, free + params[4:], use_tqdm=False)
    for a, o in zip(alone, outs[:2]):
        assert o.error is None and o.outputs[0].token_ids == a.outputs[0].token_ids
    for o, text in zip(outs[2:], ["aa", "aa", "ab"]):
        assert "no token could be sampled" in o.error and o.error_param is None
        assert o.outputs[0].text == text and o.outputs[0].finish_reason == "error"
    assert_all_blocks_back(default_llm)
