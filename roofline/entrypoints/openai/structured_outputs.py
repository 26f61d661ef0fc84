"""Request fields -> StructuredOutputsParams, checked by compiling before the engine sees the request.

Accepted forms (one per request; two are a 400):
  response_format   OpenAI: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
                    "schema", "strict"}} (the schema is always enforced: "strict" is accepted, not needed)
  structured_outputs  vLLM: {"json" | "regex" | "choice" | "grammar" | "json_object", "disable_any_whitespace"}
  guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older fields
The grammar compiles on the engine's compile threads (shared cache) while the handler awaits it, so an
invalid schema / regex / grammar is a 400 naming the field and the problem, and the engine finds the
grammar ready.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from roofline.entrypoints.openai.serving_engine import bad_request
from roofline.sampling_params import SamplingParams, StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _from_response_format(rf: Any) -> Optional[StructuredOutputsParams]:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_request("response_format of type 'json_schema' needs json_schema.schema",
                              param="response_format")
        return StructuredOutputsParams(json=rf.json_schema.json_schema)
    raise bad_request(f"response_format type {rf.type!r} is not supported (text, json_object or json_schema)",
                      param="response_format")


def structured_outputs_of(req: Any) -> tuple[Optional[str], Optional[StructuredOutputsParams]]:
    """(the request field that asked, its params), or (None, None) when the output is free."""
    found: list[tuple[str, Any]] = []
    if req.response_format is not None and req.response_format.type != "text":
        found.append(("response_format", req.response_format))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", req.structured_outputs))
    found += [(f, getattr(req, f)) for f in GUIDED_FIELDS if getattr(req, f) is not None]
    if not found:
        return None, None
    if len(found) > 1:
        names = ", ".join(f for f, _ in found)
        raise bad_request(f"only one structured output constraint per request: got {names}", param=found[1][0])
    field, value = found[0]
    try:
        if field == "response_format":
            return field, _from_response_format(value)
        if field == "structured_outputs":
            known = set(StructuredOutputsParams.__dataclass_fields__)
            unknown = sorted(set(value) - known)
            if unknown:
                raise bad_request(f"invalid structured_outputs: unknown key(s) {unknown} "
                                  f"(known: {', '.join(sorted(known))})", param=field)
            return field, StructuredOutputsParams(**value)
        return field, StructuredOutputsParams(**{GUIDED_FIELDS[field]: value})
    except ValueError as e:
        raise bad_request(_named(str(e), field), param=field) from None


def _named(message: str, field: str) -> str:
    """Rename sampling_params.py's / compiler.py's "invalid structured_outputs.<kind>: ..." after the request field."""
    if field != "structured_outputs" and message.startswith("invalid structured_outputs") and ":" in message:
        return f"invalid {field}:" + message.split(":", 1)[1]
    return message


async def attach_structured_outputs(engine: Any, req: Any, params: SamplingParams) -> None:
    """Set params.structured_outputs from the request, once its grammar compiled (400 if it does not)."""
    field, so = structured_outputs_of(req)
    if so is not None:
        await attach_constraint(engine, so, field, params)


async def attach_constraint(engine: Any, so: StructuredOutputsParams, field: str, params: SamplingParams) -> None:
    """Set params.structured_outputs to so once its grammar compiled (a 400 naming field if it does not)."""
    if params.use_beam_search:
        raise bad_request(f"{field} does not run with use_beam_search (the beams rank by the raw model)", param=field)
    manager = getattr(getattr(engine, "core", None), "structured_output", None)
    if manager is None:
        raise bad_request("structured outputs are not available on this server", param=field)
    try:
        await asyncio.wrap_future(manager.cache.get(so))
    except ValueError as e:  # a compile failure, or a model without a tokenizer
        raise bad_request(_named(str(e), field), param=field) from None
    params.structured_outputs = so
