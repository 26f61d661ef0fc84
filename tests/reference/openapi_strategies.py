"""Hypothesis strategies from the JSON Schema that an OpenAPI document (pydantic's output) declares.

hypothesis-jsonschema would do this, but its last release breaks on the hypothesis this suite runs
(an internal API it calls is gone), so this covers the subset pydantic emits: $ref into
#/components/schemas, anyOf, enum / const, object (properties, required, additionalProperties),
array (items, min/maxItems), string (min/maxLength), integer and number (minimum / maximum, exclusive
ones), boolean and null.  An object gets its required properties and up to MAX_OPTIONAL optional ones;
free-form values ({} or additionalProperties: true) are small JSON.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

FREE_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


MAX_OPTIONAL = 4  # optional properties per object: a body with a few set reaches past validation more often


def _merge(a: dict, b: dict) -> dict:
    return {**a, **b}


def from_openapi_schema(schema: dict[str, Any], components: dict[str, Any]) -> st.SearchStrategy:
    """Values valid under schema; components: the document's components.schemas."""
    return _strategy(schema, components, depth=0)


def _strategy(schema: Any, components: dict[str, Any], depth: int) -> st.SearchStrategy:
    if schema is True or schema == {}:
        return FREE_JSON
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: _strategy(components[name], components, depth + 1))
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([_strategy(s, components, depth) for s in schema.get("anyOf") or schema["oneOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    t = schema.get("type")
    if isinstance(t, list):
        return st.one_of([_strategy({**schema, "type": x}, components, depth) for x in t])
    if t == "null":
        return st.none()
    if t == "boolean":
        return st.booleans()
    if t == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -(2**66) - 1) + 1)
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 2**66 + 1) - 1)
        return st.integers(lo, hi)
    if t == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False)
    if t == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 40), 40))
    if t == "array":
        items = _strategy(schema.get("items", {}), components, depth + 1)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 4), 4))
    if t == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        extra = schema.get("additionalProperties", False)
        if extra is not False and not props:
            return st.dictionaries(st.text(max_size=8), _strategy(extra, components, depth + 1), max_size=3)
        fixed = {k: _strategy(v, components, depth + 1) for k, v in props.items() if k in required}
        optional = sorted(k for k in props if k not in required)
        return st.builds(_merge, st.fixed_dictionaries(fixed),
                         st.lists(st.sampled_from(optional), max_size=MAX_OPTIONAL, unique=True).flatmap(
                             lambda keys: st.fixed_dictionaries(
                                 {k: _strategy(props[k], components, depth + 1) for k in keys}))
                         if optional else st.just({}))
    return FREE_JSON
