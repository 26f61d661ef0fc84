"""StructuredOutputsParams: exactly one constraint, shapes checked, equal constraints share a cache key."""

from __future__ import annotations

import pytest

from roofline.sampling_params import SamplingParams, StructuredOutputsParams


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match=r"exactly one of .* \(got none\)"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(choice=["a", "b"]).kind == "choice"


@pytest.mark.parametrize("kwargs, field", [
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json=[1, 2]), "structured_outputs.json"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(grammar=3), "structured_outputs.grammar"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", ""]), "structured_outputs.choice"),
    (dict(json_object="yes"), "structured_outputs.json_object"),
    (dict(regex="a", disable_any_whitespace="no"), "structured_outputs.disable_any_whitespace"),
])
def test_bad_shapes_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"invalid {field}"):
        StructuredOutputsParams(**kwargs)


def test_cache_key_ignores_key_order_and_form():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert a.json == b.json and a.cache_key() == b.cache_key()
    assert a.cache_key() != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).cache_key()
    assert StructuredOutputsParams(regex="a").cache_key() != StructuredOutputsParams(grammar="a").cache_key()


def test_sampling_params_takes_the_dict_form():
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.structured_outputs.regex == "[0-9]+"
    assert p.clone().structured_outputs.cache_key() == p.structured_outputs.cache_key()
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="[0-9]+")
