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


def test_server_tokenizer_renders_request_templates_only_when_trusted():
    import asyncio

    from roofline.entrypoints.openai.serving_engine import APIError
    from roofline.entrypoints.openai.tokenization import ServerTokenizer
    from roofline.model_executor.loader.source import load_tokenizer, resolve_source

    tok = load_tokenizer(resolve_source(None))
    messages = [{"role": "user", "content": "hi"}]

    async def render(server_tok, template):
        return await server_tok.render_chat(messages, add_generation_prompt=True, chat_template=template)

    closed = ServerTokenizer(tok, 512)
    with pytest.raises(APIError, match="--trust-request-chat-template"):
        asyncio.run(render(closed, SIMPLE))
    trusted = ServerTokenizer(tok, 512, trust_request_chat_template=True)
    try:
        assert asyncio.run(render(trusted, SIMPLE)) == "<user>hi<a>"
        with pytest.raises(APIError, match="chat template"):
            asyncio.run(render(trusted, "{{ 'hello ' * 1000000000 }}"))
        own = asyncio.run(render(trusted, None))  # the model's own template, in the thread pool
        assert "hi" in own and own == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    finally:
        trusted.close()
        closed.close()


SLOW = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


def test_slow_request_templates_never_hold_up_other_chat_rendering():
    """Eight slow request templates (each killed at its 1.5 s limit; two sandbox children render them,
    so they hold the template pool for ~6 s) from several clients: meanwhile the model's own template and
    tokenization answer at once, since request templates have their own pool.  A client past its cap of
    renders in flight gets 429 at once, other clients are not affected, and the cap frees up afterwards."""
    import asyncio

    from roofline.entrypoints.openai.serving_engine import APIError
    from roofline.entrypoints.openai.tokenization import ServerTokenizer
    from roofline.model_executor.loader.source import load_tokenizer, resolve_source

    tok = load_tokenizer(resolve_source(None))
    messages = [{"role": "user", "content": "hi"}]
    server_tok = ServerTokenizer(tok, 512, trust_request_chat_template=True, template_timeout_s=1.5,
                                 max_template_renders_per_client=2)

    async def slow(client):
        try:
            await server_tok.render_chat(messages, add_generation_prompt=True, chat_template=SLOW, client=client)
        except APIError as e:
            return e.status, e.message
        return 200, ""

    async def scenario():
        slow_tasks = [asyncio.ensure_future(slow(f"10.0.0.{i // 2}")) for i in range(8)]  # 4 clients x 2
        await asyncio.sleep(0.3)  # all eight are in flight
        over_cap = await slow("10.0.0.0")
        t0 = time.monotonic()
        for _ in range(5):
            text = await server_tok.render_chat(messages, add_generation_prompt=True)
            ids = await server_tok.encode(text, add_special_tokens=False)
        ordinary_s = time.monotonic() - t0
        results = await asyncio.gather(*slow_tasks)
        slow_s = time.monotonic() - t0
        after = await server_tok.render_chat(messages, add_generation_prompt=True, chat_template=SIMPLE,
                                             client="10.0.0.0")
        return over_cap, ordinary_s, ids, results, slow_s, after

    try:
        over_cap, ordinary_s, ids, results, slow_s, after = asyncio.run(scenario())
    finally:
        server_tok.close()
    assert over_cap[0] == 429 and "too many chat_template renders" in over_cap[1]
    assert all(status == 400 and "within 1.5 s" in msg for status, msg in results), results
    assert ids and slow_s > 4.0  # the slow ones really did hold the template pool ...
    assert ordinary_s < slow_s / 2, (ordinary_s, slow_s)  # ... while ordinary rendering went on
    assert after == "<user>hi<a>" and not server_tok._renders_by_client
