"""StructuredOutputsParams: what a request's output must match (vLLM's form).

Exactly one constraint per request: a JSON schema (`json`), a regular expression (`regex`), one of a
list of strings (`choice`), a grammar (`grammar`: xgrammar EBNF / GBNF, or Lark when it has no `::=`),
or any JSON object (`json_object=True`).  Pure Python, no xgrammar: validation here checks shapes and
types; whether the schema / regex / grammar itself is valid is found out by compiling it
(structured_output/compiler.py), which names the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False  # JSON: no free whitespace between elements
    # The constraint starts after the first output token with this id (a reasoning model's end-of-think):
    # the thinking before it is free.  None: from the first token.  Not part of the compiled grammar.
    start_after_token_id: Optional[int] = None

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            got = ", ".join(set_) if set_ else "none"
            raise ValueError("invalid structured_outputs: exactly one of json, regex, choice, grammar or "
                             f"json_object must be set (got {got})")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"invalid structured_outputs.json: the schema is not valid JSON: {e}") from None
            self.json = parsed
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"invalid structured_outputs.json: a JSON schema must be an object, "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"invalid structured_outputs.{name}: must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise ValueError("invalid structured_outputs.choice: must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        t = self.start_after_token_id
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ValueError("invalid structured_outputs.start_after_token_id: must be a token id")
        for name in ("json_object", "disable_any_whitespace"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"invalid structured_outputs.{name}: must be a boolean")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str, bool]:
        """Equal keys compile to the same grammar (JSON schemas compare with sorted keys)."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json":
            text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            text = json.dumps(value)
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text, self.disable_any_whitespace
