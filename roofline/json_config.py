"""vLLM-style --*-config flags given as JSON text (or a dict): parsed, checked for unknown fields (the
--*-config classes of roofline/config.py read them with it)."""

from __future__ import annotations

import json


def json_fields(value, what: str, known: set[str]) -> dict:
    """A config given as JSON text or a dict (vLLM's --*-config flags) as a dict of known fields; bad JSON, a
    non-object or an unknown field is a ValueError naming `what`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object")
    unknown = set(value) - known
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    return value
