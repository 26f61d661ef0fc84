"""Chat templates given by the operator (--chat-template, LLM.chat(chat_template=...)) and the shape a
template wants message content in (--chat-template-content-format).

load_chat_template: a path to a Jinja file, or the template text itself (anything with "{{" or "{%").
Content format: "string" joins a message's text parts into one string (most templates); "openai"
keeps OpenAI's list of {"type": "text", "text": ...} parts (templates that loop over content); "auto"
looks at the template for such a loop.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

CONTENT_FORMATS = ("auto", "string", "openai")
_LOOPS_OVER_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+\w+(?:\.content|\[\s*['\"]content['\"]\s*\])|content\s*\[\s*0\s*\]|content\s+is\s+(?:not\s+)?string")


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """The template text of --chat-template (a file's path, or the template itself); None stays None."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a Jinja template "
                     "(no '{{' or '{%')")


def resolve_content_format(requested: str, template: Optional[str]) -> str:
    """"string" or "openai" for the template that will render (auto: does it loop over content parts)."""
    if requested not in CONTENT_FORMATS:
        raise ValueError(f"--chat-template-content-format must be one of {', '.join(CONTENT_FORMATS)}, "
                         f"got {requested!r}")
    if requested != "auto":
        return requested
    return "openai" if template and _LOOPS_OVER_CONTENT.search(template) else "string"


def format_content(content: Any, fmt: str) -> Any:
    """A message's content for the template: text parts joined ("string") or as parts ("openai")."""
    if content is None:
        return "" if fmt == "string" else []
    if isinstance(content, str):
        return content if fmt == "string" else [{"type": "text", "text": content}]
    parts = [{"type": "text", "text": p["text"]} for p in content]
    return "\n".join(p["text"] for p in parts) if fmt == "string" else parts
