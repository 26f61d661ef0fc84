"""Tool-call parsers: canned outputs of each format give the expected calls and content, and every split of
them (char by char, token-like pieces, random cuts, random marker soup) streams to exactly the non-streamed
result. Pure text, no tokenizer or model."""

from __future__ import annotations

import json
import re
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roofline.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from roofline.entrypoints.openai.tool_parsers.base import DeltaResult, ExtractedToolCalls, ToolCall, ToolParser

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

NESTED = {"texte": "héllo wörld 日本語 🌍 \"quoted\" \\ back", "options": {
    "niveaux": [1, 2, {"deep": [True, None, 3.5, -7]}], "vide": {}, "liste": []}}
NESTED_JSON = json.dumps(NESTED, ensure_ascii=False)


def call(name: str, args: Optional[dict] = None) -> ToolCall:
    return ToolCall(name, json.dumps(args or {}, ensure_ascii=False))


def hermes_block(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'


WEATHER = {"city": "Paris"}
BAD_JSON = '{"name": "f", "arguments": {"a": }'

# parser -> [(id, text, expected calls, expected content)]
CASES: dict[str, list[tuple[str, str, list[ToolCall], Optional[str]]]] = {
    "hermes": [
        ("plain", "The capital of France is Paris.", [], "The capital of France is Paris."),
        ("whitespace", " \n ", [], None),
        ("one", hermes_block("get_weather", WEATHER), [call("get_weather", WEATHER)], None),
        ("several", hermes_block("get_weather", WEATHER) + "\n" + hermes_block("get_time", {"tz": "CET"}),
         [call("get_weather", WEATHER), call("get_time", {"tz": "CET"})], None),
        ("text-before", "Let me check the weather.\n\n" + hermes_block("get_weather", WEATHER),
         [call("get_weather", WEATHER)], "Let me check the weather.\n\n"),
        ("text-after", hermes_block("f", {}) + "\nDone.", [call("f")], "\nDone."),
        ("parameters-and-string-args",
         '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call><tool_call>{"name": "g", '
         '"arguments": "{\\"b\\": 2}"}</tool_call>', [call("f", {"a": 1}), call("g", {"b": 2})], None),
        ("no-close-tag", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', [call("f", {"a": 1})], None),
        ("no-close-before-next", '<tool_call>{"name": "f", "arguments": {}}\n' + hermes_block("g", {}),
         [call("f"), call("g")], None),
        ("unicode-nested", "Voilà :\n" + hermes_block("traduire", NESTED), [call("traduire", NESTED)], "Voilà :\n"),
        ("bad-json", f"Sure.\n<tool_call>\n{BAD_JSON}\n</tool_call>", [],
         f"Sure.\n<tool_call>\n{BAD_JSON}\n</tool_call>"),
        ("bad-second", hermes_block("f", {}) + f"\n<tool_call>\n{BAD_JSON}\n</tool_call>", [call("f")],
         f"<tool_call>\n{BAD_JSON}\n</tool_call>"),
        ("cut", '<tool_call>\n{"name": "f", "argu', [], '<tool_call>\n{"name": "f", "argu'),
        ("no-name", '<tool_call>{"arguments": {}}</tool_call>', [], '<tool_call>{"arguments": {}}</tool_call>'),
        ("nan", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', [],
         '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
        ("args-not-object", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [],
         '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
        ("almost-marker", "a <tool_cal> b <tool", [], "a <tool_cal> b <tool"),
    ],
    "llama3_json": [
        ("plain", "Paris is the capital of France.", [], "Paris is the capital of France."),
        ("one-tagged", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
         [call("get_weather", WEATHER)], None),
        ("one", '{"name": "get_weather", "parameters": {"city": "Paris"}}', [call("get_weather", WEATHER)], None),
        ("arguments-key", ' \n{"name": "f", "arguments": {"a": 1}}', [call("f", {"a": 1})], None),
        ("several", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", '
                    '"parameters": {"tz": "CET"}};', [call("get_weather", WEATHER), call("get_time", {"tz": "CET"})],
         None),
        ("text-before", 'Here: {"name": "f", "parameters": {}}', [], 'Here: {"name": "f", "parameters": {}}'),
        ("text-after", '{"name": "f", "parameters": {}}\nHope that helps.', [call("f")], "\nHope that helps."),
        ("unicode-nested", f'<|python_tag|>{{"name": "traduire", "parameters": {NESTED_JSON}}}',
         [call("traduire", NESTED)], None),
        ("cut", '{"name": "f", "parameters": {"a": 1}', [], '{"name": "f", "parameters": {"a": 1}'),
        ("not-a-call", '{"answer": 42}', [], '{"answer": 42}'),
        ("builtin-tool", '<|python_tag|>brave_search.call(query="weather")', [],
         '<|python_tag|>brave_search.call(query="weather")'),
        ("bad-second", '{"name": "f", "parameters": {}}; {"bad"}', [call("f")], '{"bad"}'),
    ],
    "mistral": [
        ("plain", "Bonjour ! Comment puis-je aider ?", [], "Bonjour ! Comment puis-je aider ?"),
        ("array-one", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
         [call("get_weather", WEATHER)], None),
        ("array-several", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                          '{"name": "get_time", "arguments": {"tz": "CET"}}]',
         [call("get_weather", WEATHER), call("get_time", {"tz": "CET"})], None),
        ("named-one", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', [call("get_weather", WEATHER)], None),
        ("named-several", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
         [call("get_weather", WEATHER), call("get_time", {"tz": "CET"})], None),
        ("text-before", 'Let me look that up.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
         [call("get_weather", WEATHER)], "Let me look that up."),
        ("call-id", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', [call("get_weather", WEATHER)],
         None),
        ("no-args-token", '[TOOL_CALLS]get_weather{"city": "Paris"}', [call("get_weather", WEATHER)], None),
        ("lone-object", '[TOOL_CALLS]{"name": "f", "arguments": {"a": 1}}', [call("f", {"a": 1})], None),
        ("unicode-nested", f"Voilà[TOOL_CALLS]traduire[ARGS]{NESTED_JSON}", [call("traduire", NESTED)], "Voilà"),
        ("cut", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', [], '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'),
        ("array-bad-element", '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"arguments": {}}]', [],
         '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"arguments": {}}]'),
        ("bad-second", "[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{oops}", [call("f")], "[TOOL_CALLS]g[ARGS]{oops}"),
        ("marker-only", "[TOOL_CALLS]", [], "[TOOL_CALLS]"),
    ],
    "pythonic": [
        ("plain", "It is sunny in Paris.", [], "It is sunny in Paris."),
        ("one", '[get_weather(city="Paris")]', [call("get_weather", WEATHER)], None),
        ("several", '[get_weather(city="Paris", days=3), get_time(tz=None, exact=True, ratio=-0.5), noop()]',
         [call("get_weather", {"city": "Paris", "days": 3}),
          call("get_time", {"tz": None, "exact": True, "ratio": -0.5}), call("noop")], None),
        ("wrapped", '<|python_start|>[get_weather(city="Paris")]<|python_end|>', [call("get_weather", WEATHER)],
         None),
        ("json-spellings", "[f(flag=true, x=null, y=false)]", [call("f", {"flag": True, "x": None, "y": False})],
         None),
        ("unicode-nested",
         '[traduire(texte="héllo wörld 日本語 🌍 \\"quoted\\" \\\\ back", options={"niveaux": [1, 2, '
         '{"deep": (True, None, 3.5, -7)}], "vide": {}, "liste": []})]', [call("traduire", NESTED)], None),
        ("brackets-in-strings", "[f(s=']) # ', t=\"\"\"a\nb]\"\"\")]", [call("f", {"s": "]) # ", "t": "a\nb]"})],
         None),
        ("dotted", '[brave_search.call(query="x")]', [call("brave_search.call", {"query": "x"})], None),
        ("text-after", "[f()]\nDone.", [call("f")], "\nDone."),
        ("text-before", 'Sure! [get_weather(city="Paris")]', [], 'Sure! [get_weather(city="Paris")]'),
        ("unclosed", '[get_weather(city="Paris")', [], '[get_weather(city="Paris")'),
        ("positional", '[get_weather("Paris")]', [], '[get_weather("Paris")]'),
        ("not-calls", "[1, 2, 3] are numbers.", [], "[1, 2, 3] are numbers."),
        ("expression", "[f(x=os.environ)]", [], "[f(x=os.environ)]"),
        ("empty", "[]", [], "[]"),
        ("citation", "[citation needed] Paris is big.", [], "[citation needed] Paris is big."),
    ],
    "deepseek_v3": [
        ("plain", "Paris is the capital.", [], "Paris is the capital."),
        ("v3-one", f'{BEGIN}{CB}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{CE}{END}',
         [call("get_weather", WEATHER)], None),
        ("v3-several", f'{BEGIN}{CB}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{CE}\n'
                       f'{CB}function{SEP}get_time\n```json\n{{"tz": "CET"}}\n```{CE}{END}',
         [call("get_weather", WEATHER), call("get_time", {"tz": "CET"})], None),
        ("text-before", f'Let me check.\n\n{BEGIN}{CB}function{SEP}f\n```json\n{{}}\n```{CE}{END}', [call("f")],
         "Let me check.\n\n"),
        ("v31-one", f'{BEGIN}{CB}get_weather{SEP}{{"city": "Paris"}}{CE}{END}', [call("get_weather", WEATHER)], None),
        ("v31-bare", f'{CB}get_weather{SEP}{{"city": "Paris"}}{CE}{CB}g{SEP}{{}}{CE}',
         [call("get_weather", WEATHER), call("g")], None),
        ("unicode-nested", f"Voilà{BEGIN}{CB}function{SEP}traduire\n```json\n{NESTED_JSON}\n```{CE}{END}",
         [call("traduire", NESTED)], "Voilà"),
        ("text-after", f"{BEGIN}{CB}f{SEP}{{}}{CE}{END}\nDone.", [call("f")], "\nDone."),
        ("bad-json", f'{BEGIN}{CB}function{SEP}f\n```json\n{{"a": }}\n```{CE}{END}', [],
         f'{BEGIN}{CB}function{SEP}f\n```json\n{{"a": }}\n```{CE}{END}'),
        ("no-sep", f"{BEGIN}{CB}f {{}}{CE}{END}", [], f"{BEGIN}{CB}f {{}}{CE}{END}"),
        ("bad-second", f"{BEGIN}{CB}f{SEP}{{}}{CE}{CB}g{SEP}{{oops{CE}{END}", [call("f")],
         f"{CB}g{SEP}{{oops{CE}{END}"),
        ("cut", f'{BEGIN}{CB}function{SEP}f\n```json\n{{"a": 1', [], f'{BEGIN}{CB}function{SEP}f\n```json\n{{"a": 1'),
    ],
    "qwen3_coder": [
        ("plain", "Paris is the capital.", [], "Paris is the capital."),
        ("one", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                "</parameter>\n</function>\n</tool_call>", [call("get_weather", {"city": "Paris", "days": 3})], None),
        ("several", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=noop>\n</function>\n</tool_call>",
         [call("get_weather", WEATHER), call("noop")], None),
        ("text-before", "I'll check.\n<tool_call>\n<function=f>\n<parameter=x>\n1.5\n</parameter>\n</function>\n"
                        "</tool_call>", [call("f", {"x": 1.5})], "I'll check.\n"),
        ("bare-function", "<function=f>\n<parameter=x>\ntrue\n</parameter>\n</function>", [call("f", {"x": True})],
         None),
        ("missing-param-close", "<tool_call>\n<function=f>\n<parameter=a>\nx\n<parameter=b>\nnull\n</function>\n"
                                "</tool_call>", [call("f", {"a": "x", "b": None})], None),
        ("values", '<tool_call>\n<function=write>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=code>\n'
                   'def f():\n    return {"a": [1]}\n\n</parameter>\n<parameter=obj>\n{"k": [1, {"x": null}]}\n'
                   '</parameter>\n<parameter=quoted>\n"s"\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n'
                   '</function>\n</tool_call>',
         [call("write", {"path": "/tmp/a.py", "code": 'def f():\n    return {"a": [1]}\n',
                         "obj": {"k": [1, {"x": None}]}, "quoted": '"s"', "zip": "01234"})], None),
        ("unicode-nested", "Voilà\n<tool_call>\n<function=traduire>\n<parameter=texte>\nhéllo 日本語 🌍\n</parameter>\n"
                           f"<parameter=options>\n{json.dumps(NESTED['options'], ensure_ascii=False)}\n</parameter>\n"
                           "</function>\n</tool_call>",
         [call("traduire", {"texte": "héllo 日本語 🌍", "options": NESTED["options"]})], "Voilà\n"),
        ("cut", "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n", [],
         "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n"),
        ("hermes-json", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', [],
         '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
        ("bad-second", "<function=f>\n</function>\n<function=g\n<parameter=x>1</parameter></function>", [call("f")],
         "<function=g\n<parameter=x>1</parameter></function>"),
    ],
}

CASE_PARAMS = [pytest.param(parser, text, calls, content, id=f"{parser}-{cid}")
               for parser, cases in CASES.items() for cid, text, calls, content in cases]

# Pieces of each format for random "marker soup" outputs: mostly malformed, sometimes valid.
SOUP = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", "</tool", '{"name": "f", "arguments": {"a": 1}}', "{", "}",
               '"', "\n", " ", "x", "é"],
    "llama3_json": ["<|python_tag|>", '{"name": "f", "parameters": {"a": 1}}', ";", " ", "\n", "{", "}", '"', "x",
                    "<|python"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "f", "abc", '{"a": 1}', '[{"name": "f", "arguments": {}}]',
                "[", "]", "{", "}", ",", " ", "[TOOL"],
    "pythonic": ["[", "]", "(", ")", "f(", "a=1", ", ", '"s"', "'", '"', "#", "\n", "<|python_start|>",
                 "<|python_end|>", "x", "true"],
    "deepseek_v3": [BEGIN, END, CB, CE, SEP, "function", "f", "\n", "```json\n", "```", '{"a": 1}', "{", "}", " ",
                    "<｜tool▁"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=f>", "<function=", "</function>", "<parameter=p>",
                    "</parameter>", "\n", "1", "x", ">", "<", "{", "}"],
}

_TOKEN = re.compile(r"<｜[^｜]*｜>|<\|[a-z_]+\|>|\[[A-Z_]+\]|</?[a-z_]+[>=]|\w+|\s+|.", re.S)


def split_at(text: str, cuts) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream(cls: type[ToolParser], pieces: list[str]) -> ExtractedToolCalls:
    """Feed the pieces, check each delta's shape, and assemble the streamed result."""
    parser = cls(tokenizer=None)
    content, names, args = [], [], []
    for result in [parser.extract_tool_calls_streaming(p) for p in pieces] + [parser.finish()]:
        if result is None:
            continue
        assert result.content or result.tool_calls, "an empty DeltaResult should be None"
        if result.content:
            content.append(result.content)
        for delta in result.tool_calls:
            if delta.name is not None:
                assert delta.index == len(names), "a call's name comes once, in order"
                names.append(delta.name)
                args.append([])
            else:
                assert delta.index < len(names), "arguments before the call's name"
            if delta.arguments:
                args[delta.index].append(delta.arguments)
    assert parser.finish() is None
    return ExtractedToolCalls("".join(content) or None,
                              [ToolCall(n, "".join(a)) for n, a in zip(names, args)])


def assert_streams_same(parser: str, pieces: list[str]) -> None:
    cls = get_tool_parser(parser)
    expected = cls().extract_tool_calls("".join(pieces))
    assert stream(cls, pieces) == expected


@pytest.mark.parametrize("parser, text, calls, content", CASE_PARAMS)
def test_extract(parser, text, calls, content):
    assert get_tool_parser(parser)().extract_tool_calls(text) == ExtractedToolCalls(content, calls)


@pytest.mark.parametrize("parser, text, calls, content", CASE_PARAMS)
def test_stream_char_by_char_and_by_token(parser, text, calls, content):
    assert stream(get_tool_parser(parser), list(text)) == ExtractedToolCalls(content, calls)
    assert stream(get_tool_parser(parser), _TOKEN.findall(text)) == ExtractedToolCalls(content, calls)
    assert stream(get_tool_parser(parser), [text]) == ExtractedToolCalls(content, calls)


@pytest.mark.parametrize("parser", sorted(CASES))
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_stream_random_splits(parser, data):
    text = data.draw(st.sampled_from([case[1] for case in CASES[parser]]))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=40))
    assert_streams_same(parser, split_at(text, cuts))


@pytest.mark.parametrize("parser", sorted(SOUP))
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_stream_marker_soup(parser, data):
    """Arbitrary mixes of a format's markers and fragments: nothing raises, streaming agrees."""
    text = "".join(data.draw(st.lists(st.sampled_from(SOUP[parser]), max_size=25)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=25))
    assert_streams_same(parser, split_at(text, cuts))


def test_stream_sends_calls_early():
    """A call goes out once its markup is complete, before the output ends."""
    parser = get_tool_parser("hermes")()
    first = hermes_block("f", {"a": 1})
    assert parser.extract_tool_calls_streaming("Hi <tool") == DeltaResult(content="Hi ")
    result = parser.extract_tool_calls_streaming(first[len("<tool"):] + "\n<tool_call>\n{")
    assert [(d.index, d.name, d.arguments) for d in result.tool_calls] == [(0, "f", '{"a": 1}')]
    assert result.content is None


def test_whitespace_before_markup_is_held():
    parser = get_tool_parser("hermes")()
    assert parser.extract_tool_calls_streaming("\n\n") is None
    assert parser.extract_tool_calls_streaming(hermes_block("f", {})).content is None


def test_registry():
    assert sorted(TOOL_PARSERS) == ["deepseek_v3", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"]
    for name, cls in TOOL_PARSERS.items():
        assert cls.name == name and issubclass(cls, ToolParser)
    with pytest.raises(ValueError, match=r"unknown --tool-call-parser 'nope'; one of: deepseek_v3, hermes"):
        get_tool_parser("nope")


def test_unknown_parser_names_fail_at_start_up_naming_the_flag():
    from roofline.entrypoints.openai.serving_chat import ChatOptions

    with pytest.raises(ValueError, match="--tool-call-parser 'nope'"):
        ChatOptions(tool_call_parser="nope")
    with pytest.raises(ValueError, match="--reasoning-parser 'nope'"):
        ChatOptions(reasoning_parser="nope")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ChatOptions(enable_auto_tool_choice=True)
    assert ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
