"""Request chat templates render in a child process under limits: a template that allocates gigabytes
or loops for ever is a clear error, the child is replaced, and ordinary templates still render."""

from __future__ import annotations

import time

import pytest

from roofline.entrypoints.openai.template_sandbox import SandboxedTemplateRenderer, TemplateRenderError

SIMPLE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
VARS = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}


@pytest.fixture(scope="module")
def renderer():
    r = SandboxedTemplateRenderer(timeout_s=2.0, max_chars=10_000)
    yield r
    r.close()


def test_an_ordinary_template_renders(renderer):
    assert renderer.render(SIMPLE, VARS) == "<user>hi<a>"
    assert renderer.render("{{ [1, 2] | tojson }}{{ bos_token }}", {"bos_token": "<s>"}) == "[1, 2]<s>"


@pytest.mark.parametrize("template,why", [
    ("{{ 'hello ' * 1000000000 }}", "memory"),                # 6 GB string: the address-space limit
    ("{% for i in range(100000) %}{{ 'abcdefghij' }}{% endfor %}", "exceeds"),  # output-size limit
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "within"),  # time limit
    ("{{ raise_exception('no') }}", "no"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),  # the sandbox
])
def test_hostile_templates_fail_cleanly_and_the_next_renders(renderer, template, why):
    t0 = time.monotonic()
    with pytest.raises(TemplateRenderError, match=why):
        renderer.render(template, VARS)
    assert time.monotonic() - t0 < 15
    assert renderer.render(SIMPLE, VARS) == "<user>hi<a>"
