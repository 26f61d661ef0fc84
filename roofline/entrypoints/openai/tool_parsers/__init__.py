"""Tool-call parsers: a model's output text -> OpenAI tool calls and content, whole or streamed.

One module per output format, all behind `base.ToolParser`; `TOOL_PARSERS` maps the --tool-call-parser
names (vLLM's) to the classes. A server makes one parser per output (streaming keeps state).
"""

from __future__ import annotations

from roofline.entrypoints.openai.tool_parsers.base import (DeltaResult, ExtractedToolCalls, ToolCall,
                                                           ToolCallDelta, ToolParser)
from roofline.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from roofline.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from roofline.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from roofline.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from roofline.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from roofline.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser,
                DeepSeekV3ToolParser, Qwen3CoderToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name` (ValueError naming the known ones)."""
    try:
        return TOOL_PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown --tool-call-parser {name!r}; one of: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "get_tool_parser", "ToolParser", "ToolCall", "ExtractedToolCalls", "ToolCallDelta",
           "DeltaResult"]
