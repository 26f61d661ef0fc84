"""DeepSeek-R1 reasoning: the output is reasoning up to </think>, whether or not it opens with <think>.

R1 always reasons (its newer chat templates put the <think> in the prompt), so an output with no </think>
is all reasoning, as in vLLM. A prompt ending with </think> (the reasoning already closed) makes the output
all content.
"""

from __future__ import annotations

from roofline.entrypoints.openai.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        return self.reasoning_enabled(prompt_text)
