"""SamplingParams: how one request turns logits into tokens and when it stops (vLLM-compatible), and
StructuredOutputsParams: what its output must match."""

from __future__ import annotations

import copy
import enum
import json
import math
from dataclasses import dataclass
from typing import Any, Optional, Union


# A seed is a signed 64-bit integer (the range OpenAI-style servers accept and msgpack carries).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# The widest beam search: every live beam returns its top 2 * width logprobs each step, so a step weighs at
# most 64 * 128 candidates.
MAX_BEAM_WIDTH = 64


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's form).

    Exactly one constraint per request: a JSON schema (`json`), a regular expression (`regex`), one of a
    list of strings (`choice`), a grammar (`grammar`: xgrammar EBNF / GBNF, or Lark when it has no `::=`),
    or any JSON object (`json_object=True`).  Pure Python, no xgrammar: validation here checks shapes and
    types; whether the schema / regex / grammar itself is valid is found out by compiling it
    (structured_output/compiler.py), which names the problem.
    """

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
        set_ = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
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
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

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


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Optional[StructuredOutputsParams] = None  # JSON schema / regex / choice / grammar
    # prefill/decode disaggregation (core/kv_connector.py KVTransferParams): do_remote_decode, ...
    kv_transfer_params: Optional[dict] = None
    # beam search (core/beam_search.py): n beams, ranked by cumulative logprob / length ** length_penalty; one
    # output, when the search ends, carrying the n best hypotheses (sampling options do not apply)
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value, why: str) -> None:
            raise ValueError(f"invalid sampling parameter {name}={value!r}: {why}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "length_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                bad(name, value, "must be a finite number")
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                bad(name, getattr(self, name), "must be an integer")
        if self.n < 1:
            bad("n", self.n, "must be an integer >= 1" + (" (with use_beam_search: the beam width, beam_width)"
                                                          if self.use_beam_search else ""))
        if self.temperature < 0.0:
            bad("temperature", self.temperature, "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < 0:
            bad("top_k", self.top_k, "must be -1 (disabled), 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "must be in [0, 1]")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", self.repetition_penalty, "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", self.logprobs, "must be an integer >= 0")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0
        ):
            bad("prompt_logprobs", self.prompt_logprobs, "must be an integer >= 0")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", self.seed, f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (64-bit)")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", self.stop, "stop strings must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams or a dict")
        if self.use_beam_search:
            self._validate_beam_search(bad)

    def _validate_beam_search(self, bad) -> None:
        """Beam search ranks by the model's raw logprobs and stops on EOS and max_tokens only: the options
        that would change that are refused rather than ignored."""
        if self.n > MAX_BEAM_WIDTH:
            bad("n", self.n, f"with use_beam_search n is the beam width (beam_width), at most {MAX_BEAM_WIDTH}")
        unsupported = {
            "stop": bool(self.stop), "stop_token_ids": bool(self.stop_token_ids), "min_tokens": self.min_tokens > 0,
            "logprobs": self.logprobs is not None, "prompt_logprobs": self.prompt_logprobs is not None,
            "repetition_penalty": self.repetition_penalty != 1.0, "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "structured_outputs": self.structured_outputs is not None,
            "kv_transfer_params": self.kv_transfer_params is not None,
        }
        for name, used in unsupported.items():
            if used:
                bad(name, getattr(self, name), "is not supported with use_beam_search")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)


@dataclass
class BeamSearchParams:
    """LLM.beam_search's parameters (vLLM's names): beam_width beams of up to max_tokens new tokens; finished
    hypotheses rank by cumulative logprob / (generated tokens) ** length_penalty; ignore_eos: EOS is an
    ordinary token, so every hypothesis runs to max_tokens."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"invalid beam search parameter beam_width={self.beam_width!r}: "
                             f"must be an integer in [1, {MAX_BEAM_WIDTH}]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"invalid beam search parameter max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"invalid beam search parameter length_penalty={self.length_penalty!r}: "
                             "must be a finite number")

    def sampling_params(self) -> SamplingParams:
        """The engine request that runs this search (what AsyncLLM callers submit for use_beam_search)."""
        return SamplingParams(n=self.beam_width, use_beam_search=True, length_penalty=float(self.length_penalty),
                              max_tokens=self.max_tokens, ignore_eos=bool(self.ignore_eos))
