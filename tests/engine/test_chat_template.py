"""Chat templates the operator gives (a file or the text) and the content format they want: offline
LLM.chat renders with them, text parts joined or kept as parts as the template needs."""

from __future__ import annotations

import pytest

from roofline import SamplingParams
from roofline.engine.chat_template import load_chat_template, resolve_content_format

PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% for p in m.content %}{{ p.text }}|{% endfor %}"
                  "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
STRING_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def test_load_and_detect(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(STRING_TEMPLATE)
    assert load_chat_template(str(f)) == STRING_TEMPLATE == load_chat_template(STRING_TEMPLATE)
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="--chat-template"):
        load_chat_template("no/such/file.jinja")
    assert resolve_content_format("auto", PARTS_TEMPLATE) == "openai"
    assert resolve_content_format("auto", STRING_TEMPLATE) == "string"
    assert resolve_content_format("string", PARTS_TEMPLATE) == "string"
    with pytest.raises(ValueError, match="content-format"):
        resolve_content_format("xml", None)


def test_llm_chat_renders_with_the_given_template_and_content_format(default_llm):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    params = SamplingParams(temperature=0, max_tokens=2)
    parts = default_llm.chat(msgs, params, use_tqdm=False, chat_template=PARTS_TEMPLATE)
    assert parts[0].prompt == "<user>Hi|there|<assistant>"
    joined = default_llm.chat(msgs, params, use_tqdm=False, chat_template=STRING_TEMPLATE)
    assert joined[0].prompt == "<user>Hi\nthere<assistant>"
    cont = default_llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], params,
                            use_tqdm=False, continue_final_message=True)
    assert cont[0].prompt.endswith("Hello")
