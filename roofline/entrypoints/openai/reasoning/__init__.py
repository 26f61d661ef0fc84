"""Reasoning parsers: a model's output text -> (reasoning, content), whole or streamed.

One module per format, all behind `base.ReasoningParser`; `REASONING_PARSERS` maps the --reasoning-parser
names (vLLM's) to the classes. A server makes one parser per request (it reads the request's
chat_template_kwargs) and calls `reset(prompt_text)` before streaming each output.
"""

from __future__ import annotations

from roofline.entrypoints.openai.reasoning.base import ReasoningParser
from roofline.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from roofline.entrypoints.openai.reasoning.deepseek_v3 import DeepSeekV3ReasoningParser
from roofline.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, DeepSeekV3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name` (ValueError naming the known ones)."""
    try:
        return REASONING_PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown --reasoning-parser {name!r}; one of: {', '.join(sorted(REASONING_PARSERS))}") from None


__all__ = ["REASONING_PARSERS", "get_reasoning_parser", "ReasoningParser"]
