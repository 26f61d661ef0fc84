"""DeepSeek V3.1 / V3.2 reasoning: off unless the request turns thinking on.

With chat_template_kwargs `thinking` (or `enable_thinking`) true the template opens <think> in the prompt
and the output is read as DeepSeek-R1's (reasoning up to </think>); otherwise everything is content.
"""

from __future__ import annotations

from roofline.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    name = "deepseek_v3"

    def reasoning_enabled(self, prompt_text: str = "") -> bool:
        kwargs = self.chat_template_kwargs
        return bool(kwargs.get("thinking") or kwargs.get("enable_thinking")) and super().reasoning_enabled(prompt_text)
