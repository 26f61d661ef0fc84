"""The GGUF metadata cache's tokenizer snapshot answers as transformers' class does, without importing it."""

import copy
import os
import random
import subprocess
import sys

import pytest

from roofline.model_executor.loader.source import gguf_metadata_dir, load_tokenizer, resolve_source
from roofline.model_executor.loader.tokenizer_snapshot import TokenizerSnapshot, as_transformers_tokenizer

TEXTS = [
    "", " ", "Hello world!", "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n\n",
    "héllo wörld 你好 🤖 ünïcödé", "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>mid<|endoftext|>", "<|im_start|> spaced <|im_end|>", "<|im_startnot a token",
    "def f(x):\n    return x ** 2  # code\n", "1234567890 3.14159 -42 1e-9", "a" * 300, "!!!???...,,,;;;",
]


@pytest.fixture(scope="module")
def pair():
    """(the snapshot load_tokenizer gives for the default model, transformers' class on the same directory)"""
    from transformers import TokenizersBackend

    src = resolve_source(None)
    tok = load_tokenizer(src)
    assert isinstance(tok, TokenizerSnapshot), "the default model's tokenizer should load from its snapshot"
    return tok, TokenizersBackend.from_pretrained(gguf_metadata_dir(src))


def test_encode_and_decode_are_transformers_own(pair):
    snap, hf = pair
    for text in TEXTS:
        for special in (True, False):
            assert snap.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text
    rng = random.Random(0)
    specials = hf.all_special_ids
    for _ in range(200):
        ids = [rng.choice(specials) if rng.random() < 0.15 else rng.randrange(len(hf)) for _ in range(rng.randrange(1, 12))]
        for skip in (False, True):
            assert snap.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
            assert snap.convert_ids_to_tokens(ids, skip_special_tokens=skip) == \
                hf.convert_ids_to_tokens(ids, skip_special_tokens=skip)
    assert snap.decode(5) == hf.decode(5) and snap.decode([]) == hf.decode([])
    assert snap.convert_ids_to_tokens(7) == hf.convert_ids_to_tokens(7)


def test_vocabulary_and_special_tokens_are_transformers_own(pair):
    snap, hf = pair
    assert snap.get_vocab() == hf.get_vocab() and len(snap) == len(hf) and snap.vocab_size == hf.vocab_size
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(snap, name) == getattr(hf, name), name
        assert getattr(snap, name + "_id") == getattr(hf, name + "_id"), name
    assert snap.all_special_ids == hf.all_special_ids and snap.chat_template == hf.chat_template
    tokens = ["<|im_start|>", "hello", "Ġworld", "no-such-token-here"]
    assert snap.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert snap.convert_tokens_to_ids("<|im_end|>") == hf.convert_tokens_to_ids("<|im_end|>")


TEMPLATES = {
    "helpers": (  # namespace, dict, loop controls, tojson with options, strftime_now, raise_exception, variables
        "{% set ns = namespace(n=0, seen=dict(a=1)) %}{{ bos_token }}{% for m in messages %}"
        "{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}"
        "{% set ns.n = ns.n + 1 %}[{{ m.role | upper }}#{{ ns.n }}] {{ m.content | trim }}{{ eos_token }}\n"
        "{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}{{ {'k': messages | length, 'x': 'é<>'} | "
        "tojson(indent=2, sort_keys=True) }}{{ ns.seen | tojson }} {{ strftime_now('%Y') }}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
        "\n  {% if add_generation_prompt %}\n<assistant>\n  {% endif %}\n{%- if true %} end{% endif %}"),
    "generation-tag": ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                       "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"),
    "reasoning": "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.content }}\n{% endfor %}",
}
CONVERSATIONS = [
    [{"role": "user", "content": "héllo 你好"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  hi  "},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "and again"}],
]


def test_chat_templates_render_as_transformers_renders_them(pair):
    """The model's template and others through every helper: the snapshot's own rendering of a plain
    conversation is transformers' text; what it does not render itself (a `{% generation %}` tag, reasoning
    fields, tools, a continued message) is transformers' rendering too; a template's exception is raised."""
    import jinja2

    snap, hf = pair
    assert snap._compiled(snap.chat_template) is not None and snap._compiled(TEMPLATES["helpers"]) is not None
    assert snap._compiled(TEMPLATES["generation-tag"]) is None  # transformers' extension: its class renders it
    cases = [dict(chat_template=None), dict(chat_template=TEMPLATES["helpers"]),
             dict(chat_template=TEMPLATES["helpers"], enable_thinking=False),
             dict(chat_template=TEMPLATES["generation-tag"])]
    for conv in CONVERSATIONS:
        for kw in cases:
            for gen in (True, False):
                assert snap.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **kw) == \
                    hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **kw), (conv, kw)
    reasoning = [{"role": "user", "content": "q"}, {"role": "assistant", "reasoning": "r", "content": "a"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    continued = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    for conv, kw in ((reasoning, dict(chat_template=TEMPLATES["reasoning"])), (CONVERSATIONS[1], dict(tools=tools)),
                     (continued, dict(continue_final_message=True)), (CONVERSATIONS[0], dict(tokenize=True))):
        kw.setdefault("tokenize", False)
        assert snap.apply_chat_template(conv, **kw) == hf.apply_chat_template(conv, **kw), kw
    bad = [{"role": "tool", "content": "x"}]
    for tok in (snap, hf):
        with pytest.raises(jinja2.TemplateError, match="bad role tool"):
            tok.apply_chat_template(bad, tokenize=False, chat_template=TEMPLATES["helpers"])
        with pytest.raises(jinja2.exceptions.SecurityError):  # namespaces refuse underscore attributes
            tok.apply_chat_template(bad, tokenize=False, chat_template="{% set ns = namespace(_x=1) %}x")


def test_the_rest_is_transformers_class_on_the_same_files(pair):
    """What the snapshot does not serve itself goes to transformers' class: options it does not take,
    tensors; a per-thread copy is independent; xgrammar gets transformers' object."""
    snap, hf = pair
    assert snap.encode("Hello world", truncation=True, max_length=1) == hf.encode("Hello world", truncation=True,
                                                                                 max_length=1)
    import torch

    ids = torch.tensor([19556, 905, 17])
    assert snap.decode(ids) == hf.decode(ids)
    assert type(as_transformers_tokenizer(snap)).__name__ == "TokenizersBackend"
    assert as_transformers_tokenizer(hf) is hf
    other = copy.deepcopy(snap)
    assert other is not snap and other._backend is not snap._backend
    assert other.encode(TEXTS[5]) == snap.encode(TEXTS[5]) and other.name_or_path == snap.name_or_path


def test_loading_the_default_models_tokenizer_does_not_import_transformers():
    load_tokenizer(resolve_source(None))  # the cache exists before the child looks
    code = ("import sys\n"
            "from roofline.model_executor.loader.source import load_tokenizer, resolve_source\n"
            "tok = load_tokenizer(resolve_source(None))\n"
            "assert tok.decode(tok.encode('Hello world')) == 'Hello world'\n"
            "assert tok.eos_token_id is not None and tok.chat_template\n"
            "assert tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}], tokenize=False).endswith('Hi<|im_end|>\\n')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_a_directory_without_a_snapshot_loads_through_transformers(tmp_path):
    """A cache written before snapshots (or a tokenizer a snapshot cannot stand in for) loads as before."""
    import shutil

    from roofline.model_executor.loader import source as source_mod
    from roofline.model_executor.loader.tokenizer_snapshot import SNAPSHOT_FILE, STATE_FILE

    cached = gguf_metadata_dir(resolve_source(None))
    plain = tmp_path / "plain"
    shutil.copytree(cached, plain, ignore=shutil.ignore_patterns(SNAPSHOT_FILE, STATE_FILE))
    tok = source_mod._load_cached_tokenizer(str(plain))
    assert type(tok).__name__ == "TokenizersBackend"
    assert tok.encode(TEXTS[6]) == load_tokenizer(resolve_source(None)).encode(TEXTS[6])
