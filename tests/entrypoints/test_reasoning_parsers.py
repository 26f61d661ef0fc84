"""Reasoning parsers: canned outputs split into the expected (reasoning, content) per request settings, and
every split of them (char by char, random cuts, random marker soup) streams to exactly the non-streamed
parts. Pure text, no tokenizer or model."""

from __future__ import annotations

from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roofline.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningParser, get_reasoning_parser

QWEN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
OPEN_PROMPT = QWEN_PROMPT + "<think>\n"
CLOSED_PROMPT = QWEN_PROMPT + "<think>\n\n</think>\n\n"

# (id, parser, chat_template_kwargs, prompt, output, reasoning, content)
CASES: list[tuple[str, str, Optional[dict], str, str, Optional[str], Optional[str]]] = [
    ("r1-think", "deepseek_r1", None, "", "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
     "\nLet me think.\n", "The answer is 4."),
    ("r1-no-open", "deepseek_r1", None, "", "Let me think.</think>The answer.", "Let me think.", "The answer."),
    ("r1-no-end", "deepseek_r1", None, "", "Still thinking...", "Still thinking...", None),
    ("r1-empty", "deepseek_r1", None, "", "", None, None),
    ("r1-only-end", "deepseek_r1", None, "", "</think>\n\nAnswer", None, "Answer"),
    ("r1-blank-reasoning", "deepseek_r1", None, "", "<think>\n\n</think>\n\nHi\n", None, "Hi\n"),
    ("r1-unicode", "deepseek_r1", None, "", "<think>思考中… 🤔 </thi\n</think>答案是 4。", "思考中… 🤔 </thi\n", "答案是 4。"),
    ("r1-second-end", "deepseek_r1", None, "", "a</think>b</think>c", "a", "b</think>c"),
    ("r1-leading-space", "deepseek_r1", None, "", "  <think>x</think>\r\n  y", "x", "  y"),
    ("r1-thinking-tag", "deepseek_r1", None, "", "<thinking>x</think>y", "<thinking>x", "y"),
    ("r1-partial-open", "deepseek_r1", None, "", "<thi", "<thi", None),
    ("r1-blank-content", "deepseek_r1", None, "", "x</think>\n \n", "x", None),
    ("r1-closed-prompt", "deepseek_r1", None, "<think>\nplan\n</think>\n", "<think>a</think>b", None,
     "<think>a</think>b"),
    ("qwen3-think", "qwen3", None, QWEN_PROMPT, "<think>\nreason\n</think>\n\nanswer", "\nreason\n", "answer"),
    ("qwen3-no-think", "qwen3", None, QWEN_PROMPT, "Just an answer.", None, "Just an answer."),
    ("qwen3-end-without-open", "qwen3", None, QWEN_PROMPT, "a</think>b", None, "a</think>b"),
    ("qwen3-disabled", "qwen3", {"enable_thinking": False}, CLOSED_PROMPT, "<think>x</think>y", None,
     "<think>x</think>y"),
    ("qwen3-disabled-plain", "qwen3", {"enable_thinking": False}, CLOSED_PROMPT, "\nHello", None, "\nHello"),
    ("qwen3-closed-prompt", "qwen3", None, CLOSED_PROMPT, "Hello", None, "Hello"),
    ("qwen3-closed-prompt-think", "qwen3", None, CLOSED_PROMPT, "<think>x</think>y", None, "<think>x</think>y"),
    ("qwen3-open-prompt", "qwen3", None, OPEN_PROMPT, "reason</think>\n\nanswer", "reason", "answer"),
    ("qwen3-open-prompt-cut", "qwen3", {"enable_thinking": True}, OPEN_PROMPT, "reason...", "reason...", None),
    ("qwen3-cut", "qwen3", None, QWEN_PROMPT, "<think>reason", "reason", None),
    ("qwen3-empty-think", "qwen3", None, QWEN_PROMPT, "<think>\n\n</think>\n\nHello", None, "Hello"),
    ("qwen3-partial-open", "qwen3", None, QWEN_PROMPT, " <thin", None, " <thin"),
    ("qwen3-unicode", "qwen3", None, QWEN_PROMPT, "<think>考虑 🤔</think>\n答案", "考虑 🤔", "答案"),
    ("v3-off", "deepseek_v3", None, "", "<think>x</think>y", None, "<think>x</think>y"),
    ("v3-off-explicit", "deepseek_v3", {"thinking": False}, "", "Hello", None, "Hello"),
    ("v3-thinking", "deepseek_v3", {"thinking": True}, "", "x</think>\n\ny", "x", "y"),
    ("v3-enable-thinking", "deepseek_v3", {"enable_thinking": True}, "", "<think>x</think>y", "x", "y"),
    ("v3-thinking-cut", "deepseek_v3", {"thinking": True}, "", "x", "x", None),
]

CASE_PARAMS = [pytest.param(*case[1:], id=case[0]) for case in CASES]
SOUP = ["<think>", "</think>", "<thi", "</th", "<", ">", "\n", "\r\n", " ", "x", "é", "思"]
CONFIGS = [("deepseek_r1", None, ""), ("deepseek_r1", None, "</think>\n"), ("qwen3", None, QWEN_PROMPT),
           ("qwen3", None, OPEN_PROMPT), ("qwen3", {"enable_thinking": False}, CLOSED_PROMPT), ("deepseek_v3", None, ""),
           ("deepseek_v3", {"thinking": True}, "")]


def split_at(text: str, cuts) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream(parser: ReasoningParser, prompt: str, pieces: list[str]) -> tuple[Optional[str], Optional[str]]:
    parser.reset(prompt)
    reasoning, content = [], []
    for r, c in [parser.extract_reasoning_streaming(p) for p in pieces] + [parser.finish()]:
        assert r is None or r, "an empty delta should be None"
        assert c is None or c, "an empty delta should be None"
        reasoning.append(r or "")
        content.append(c or "")
    assert parser.finish() == (None, None)
    return "".join(reasoning) or None, "".join(content) or None


def assert_streams_same(name: str, kwargs: Optional[dict], prompt: str, pieces: list[str]) -> None:
    parser = get_reasoning_parser(name)(tokenizer=None, chat_template_kwargs=kwargs)
    expected = parser.extract_reasoning("".join(pieces), prompt)
    assert stream(parser, prompt, pieces) == expected


@pytest.mark.parametrize("name, kwargs, prompt, text, reasoning, content", CASE_PARAMS)
def test_extract(name, kwargs, prompt, text, reasoning, content):
    parser = get_reasoning_parser(name)(tokenizer=None, chat_template_kwargs=kwargs)
    assert parser.extract_reasoning(text, prompt) == (reasoning, content)


@pytest.mark.parametrize("name, kwargs, prompt, text, reasoning, content", CASE_PARAMS)
def test_stream_char_by_char(name, kwargs, prompt, text, reasoning, content):
    parser = get_reasoning_parser(name)(tokenizer=None, chat_template_kwargs=kwargs)
    assert stream(parser, prompt, list(text)) == (reasoning, content)
    assert stream(parser, prompt, [text]) == (reasoning, content)  # the same parser, reset


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_stream_random_splits(data):
    _, name, kwargs, prompt, text, _, _ = data.draw(st.sampled_from(CASES))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=30))
    assert_streams_same(name, kwargs, prompt, split_at(text, cuts))


@pytest.mark.parametrize("name, kwargs, prompt", CONFIGS)
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_stream_marker_soup(name, kwargs, prompt, data):
    text = "".join(data.draw(st.lists(st.sampled_from(SOUP), max_size=20)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    assert_streams_same(name, kwargs, prompt, split_at(text, cuts))


def test_stream_sends_reasoning_early_and_holds_partial_marker():
    parser = get_reasoning_parser("deepseek_r1")()
    assert parser.extract_reasoning_streaming("<think>") == (None, None)
    assert parser.extract_reasoning_streaming("\n") == (None, None)  # whitespace only so far
    assert parser.extract_reasoning_streaming("Hmm</th") == ("\nHmm", None)
    assert parser.extract_reasoning_streaming("ink>\n\n") == (None, None)
    assert parser.extract_reasoning_streaming("Four.") == (None, "Four.")
    assert parser.finish() == (None, None)


def test_starts_in_reasoning():
    r1 = get_reasoning_parser("deepseek_r1")()
    assert r1.starts_in_reasoning("") and r1.starts_in_reasoning(QWEN_PROMPT)
    assert not r1.starts_in_reasoning(CLOSED_PROMPT)  # the prompt closed the reasoning
    qwen3 = get_reasoning_parser("qwen3")
    assert qwen3().starts_in_reasoning(OPEN_PROMPT)
    assert not qwen3().starts_in_reasoning(QWEN_PROMPT)
    assert not qwen3().starts_in_reasoning(CLOSED_PROMPT)
    assert not qwen3(chat_template_kwargs={"enable_thinking": False}).starts_in_reasoning(OPEN_PROMPT)
    v3 = get_reasoning_parser("deepseek_v3")
    assert not v3().starts_in_reasoning("<think>")
    assert v3(chat_template_kwargs={"thinking": True}).starts_in_reasoning("")


def test_reasoning_enabled():
    r1, qwen3, v3 = (get_reasoning_parser(n) for n in ("deepseek_r1", "qwen3", "deepseek_v3"))
    assert r1().reasoning_enabled() and r1().reasoning_enabled(OPEN_PROMPT)
    assert not r1().reasoning_enabled("...</think>\n\n")
    assert qwen3().reasoning_enabled(QWEN_PROMPT) and not qwen3().reasoning_enabled(CLOSED_PROMPT)
    assert not qwen3(chat_template_kwargs={"enable_thinking": False}).reasoning_enabled(OPEN_PROMPT)
    assert not v3().reasoning_enabled() and not v3(chat_template_kwargs={"thinking": False}).reasoning_enabled()
    assert v3(chat_template_kwargs={"enable_thinking": True}).reasoning_enabled("<think>")


class _Vocab:
    """A stand-in with the two lookups the parsers use (no model)."""

    unk_token_id = 0

    def __init__(self, vocab):
        self.vocab = vocab

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token, self.unk_token_id)

    def get_vocab(self):
        return dict(self.vocab)


def test_end_token_id():
    cls = get_reasoning_parser("qwen3")
    assert cls(tokenizer=None).end_token_id is None
    assert cls(tokenizer=_Vocab({"<unk>": 0, "</think>": 151668})).end_token_id == 151668
    assert cls(tokenizer=_Vocab({"<unk>": 0, "</": 5})).end_token_id is None  # not one token
    assert cls(tokenizer=object()).end_token_id is None


def test_registry():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "deepseek_v3", "qwen3"]
    for name, cls in REASONING_PARSERS.items():
        assert cls.name == name and issubclass(cls, ReasoningParser)
        assert (cls.start_marker, cls.end_marker) == ("<think>", "</think>")
    with pytest.raises(ValueError, match=r"unknown --reasoning-parser 'nope'; one of: deepseek_r1, deepseek_v3, qwen3"):
        get_reasoning_parser("nope")
