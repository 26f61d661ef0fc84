"""Splitting a model's output into reasoning and content, whole or streamed.

An output is read in one of two modes, chosen per request from the chat-template kwargs and the prompt:
- reasoning off (`reasoning_enabled(prompt_text)` False: the request turned it off, or the prompt already
  ends with `end_marker`): all content;
- reasoning on: an optional `start_marker` at the start (after whitespace) is dropped, then everything up to
  the first `end_marker` is reasoning and the rest content. If the output does not start inside the
  reasoning (`starts_in_reasoning` False) and does not open with `start_marker`, it is all content; if it
  is reasoning but `end_marker` never comes (cut by max_tokens), it is all reasoning.
Markers appear in neither part. Content after `end_marker` loses its leading newlines (\\r, \\n); nothing
else is stripped. A part that is empty or whitespace only is None.

Streaming keeps the text it cannot place yet (a partial marker at the end, a part that is whitespace only so
far) and sends everything else at once, so the concatenated deltas equal the non-streamed parts for any
split of the text.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

_UNSET = object()


def _part(text: str) -> Optional[str]:
    return text if text.strip() else None


class ReasoningParser:
    """A reasoning format. Subclasses set `name` and extend `reasoning_enabled` / `starts_in_reasoning`.

    A parser instance streams one output at a time; `reset(prompt_text)` starts the next one.
    """

    name: ClassVar[str]
    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"

    def __init__(self, tokenizer: Any = None, chat_template_kwargs: Optional[dict] = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._end_token_id: Any = _UNSET
        self.reset()

    # ---- what the format decides -----------------------------------------------------------------

    def reasoning_enabled(self, prompt_text: str = "") -> bool:
        """Whether the output of this request (prompt) may hold reasoning at all: not when the prompt
        already closes it (ends with `end_marker`, as a template's "thinking off" prefix does)."""
        return not prompt_text.rstrip().endswith(self.end_marker)

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        """Whether the output is reasoning from its first token on, whatever it emits (the prompt opened
        the reasoning, or the model always reasons); False when reasoning is off for this request."""
        return self.reasoning_enabled(prompt_text) and prompt_text.rstrip().endswith(self.start_marker)

    @property
    def end_token_id(self) -> Optional[int]:
        """The tokenizer's id of `end_marker` when it is a single token, else None (no tokenizer: None)."""
        if self._end_token_id is _UNSET:
            self._end_token_id = self._lookup_token(self.end_marker)
        return self._end_token_id

    def _lookup_token(self, token: str) -> Optional[int]:
        tok = self.tokenizer
        if tok is None:
            return None
        try:
            convert = getattr(tok, "convert_tokens_to_ids", None)
            if convert is not None:
                tid = convert(token)
                if isinstance(tid, int) and tid >= 0 and tid != getattr(tok, "unk_token_id", None):
                    return tid
            get_vocab = getattr(tok, "get_vocab", None)
            tid = get_vocab().get(token) if get_vocab is not None else None
            return tid if isinstance(tid, int) else None
        except Exception:  # a tokenizer without these lookups has no such token for us
            return None

    # ---- non-streamed ----------------------------------------------------------------------------

    def extract_reasoning(self, text: str, prompt_text: str = "") -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a whole output."""
        if not self.reasoning_enabled(prompt_text):
            return None, _part(text)
        start = len(text) - len(text.lstrip())
        if text.startswith(self.start_marker, start):
            body = text[start + len(self.start_marker):]
        elif self.starts_in_reasoning(prompt_text):
            body = text
        else:
            return None, _part(text)
        reasoning, sep, content = body.partition(self.end_marker)
        return _part(reasoning), _part(content.lstrip("\r\n")) if sep else None

    # ---- streamed --------------------------------------------------------------------------------

    def reset(self, prompt_text: str = "") -> None:
        """Start streaming a new output of a request whose prompt is `prompt_text`."""
        if not self.reasoning_enabled(prompt_text):
            self._state = "content"
        else:
            self._state = "open"  # before the first non-whitespace: is there a start marker?
            self._fallback = "reasoning" if self.starts_in_reasoning(prompt_text) else "content"
        self._buf = ""  # text not yet placed
        self._held = {"reasoning": "", "content": ""}  # a part that is whitespace only so far
        self._sent = {"reasoning": False, "content": False}

    def extract_reasoning_streaming(self, delta_text: str) -> tuple[Optional[str], Optional[str]]:
        """Take the next piece of the output: (reasoning delta, content delta), None where empty."""
        self._buf += delta_text
        return self._advance(final=False)

    def finish(self) -> tuple[Optional[str], Optional[str]]:
        """End of the output: what is still held back."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[Optional[str], Optional[str]]:
        out = {"reasoning": "", "content": ""}
        while True:
            buf = self._buf
            if self._state == "open":
                rest = buf.lstrip()
                if rest.startswith(self.start_marker):
                    self._buf, self._state = rest[len(self.start_marker):], "reasoning"
                    continue
                if not final and self.start_marker.startswith(rest):  # also: whitespace only so far
                    break
                self._state = self._fallback
                continue
            if self._state == "reasoning":
                i = buf.find(self.end_marker)
                if i >= 0:
                    self._put(out, "reasoning", buf[:i])
                    self._buf, self._state = buf[i + len(self.end_marker):], "after"
                    continue
                keep = 0 if final else _partial_suffix(buf, self.end_marker)
                self._put(out, "reasoning", buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                break
            if self._state == "after":  # content after the end marker: drop its leading newlines
                rest = buf.lstrip("\r\n")
                if rest:
                    self._buf, self._state = rest, "content"
                    continue
                self._buf = ""
                break
            self._put(out, "content", buf)
            self._buf = ""
            break
        return out["reasoning"] or None, out["content"] or None

    def _put(self, out: dict, part: str, text: str) -> None:
        """Send text of a part, holding it back while the part is whitespace only."""
        if not self._sent[part]:
            text = self._held[part] + text
            if not text.strip():
                self._held[part] = text
                return
            self._held[part], self._sent[part] = "", True
        out[part] += text


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
