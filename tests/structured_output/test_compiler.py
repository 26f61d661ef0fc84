"""GrammarCache: every kind compiles; the same constraint compiles once (also when asked concurrently);
a bad schema / regex / grammar is a ValueError naming the field and the problem."""

from __future__ import annotations

import threading

import pytest

from roofline.sampling_params import StructuredOutputsParams
from roofline.structured_output.compiler import GrammarCache

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("kwargs", [
    dict(json=SCHEMA), dict(json_object=True), dict(regex=r"[a-c]{2}\d"), dict(choice=['say "hi"', "b\\c"]),
    dict(grammar='root ::= "x" [0-9]+'), dict(grammar='start: "x" DIGIT+\nDIGIT: /[0-9]/'),
])
def test_every_kind_compiles(grammar_cache, kwargs):
    import xgrammar as xgr

    assert isinstance(grammar_cache.compile(StructuredOutputsParams(**kwargs), timeout=60), xgr.CompiledGrammar)


def test_same_constraint_compiles_once(default_tokenizer):
    cache = GrammarCache(default_tokenizer, len(default_tokenizer))
    try:
        schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 4}}}
        futures = []
        threads = [threading.Thread(target=lambda: futures.append(cache.get(StructuredOutputsParams(json=schema))))
                   for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(f) for f in futures}) == 1
        same = StructuredOutputsParams(json=dict(reversed(list(schema.items()))))  # key order does not matter
        assert cache.get(same) is futures[0]
        futures[0].result(60)
        assert cache.num_compiles == 1
        cache.compile(StructuredOutputsParams(regex="x+"), timeout=60)
        assert cache.num_compiles == 2
    finally:
        cache.shutdown()


@pytest.mark.parametrize("kwargs, problem", [
    (dict(json={"type": "nonsense"}), r'structured_outputs\.json: .*nonsense'),
    (dict(regex="(ab"), r"structured_outputs\.regex: .*parenthesis"),
    (dict(grammar="root ::= "), r"structured_outputs\.grammar: .*"),
])
def test_bad_constraint_names_the_problem(grammar_cache, kwargs, problem):
    params = StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match=problem) as first:
        grammar_cache.compile(params, timeout=60)
    assert "[" not in str(first.value).split(":", 1)[1][:3]  # xgrammar's "[time] file.cc:line" prefix dropped
    with pytest.raises(ValueError):  # the failure is cached: the same future, failed
        grammar_cache.get(params).result(0)


def test_no_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="tokenizer"):
        GrammarCache(None, 100)
