"""Qwen3 reasoning: <think>...</think> at the start of the output, optional per request.

Reasoning is off when chat_template_kwargs has a false `enable_thinking` or when the prompt ends with
</think> (the template closed an empty think block): everything is content. Otherwise the output is
reasoning when it opens with <think> or when the prompt ends with an opened <think> (Qwen3 thinking-only
templates), up to </think>; an output that does neither (the model chose not to think) is all content. A
reasoning output cut before </think> is all reasoning: streamed reasoning cannot be taken back (vLLM's
non-streamed Qwen3 parser calls it content instead).
"""

from __future__ import annotations

from roofline.entrypoints.openai.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def reasoning_enabled(self, prompt_text: str = "") -> bool:
        return bool(self.chat_template_kwargs.get("enable_thinking", True)) and super().reasoning_enabled(prompt_text)
