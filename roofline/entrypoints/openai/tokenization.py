"""Tokenization and chat templates for the HTTP handlers, off the event loop.

Encoding a 15 MB prompt takes seconds; on the event loop it would stall every client (/health too).
Here it runs in a small thread pool (Rust tokenizers release the GIL), each thread with its own copy
of the tokenizer (one instance must not be used by two threads at once).  Before any work, a text too
long to fit max_model_len tokens whatever it says is refused at once: no token is longer than the
vocabulary's longest entry, so a text of more than `max_model_len x longest entry` characters
(with a margin for normalization) cannot fit.

Chat templates: the server's (--chat-template) or the model's own renders in the pool too; a template sent with the request is refused
unless the server trusts request templates, and then renders in sandboxed child processes
(template_sandbox.py) under time, memory and output limits.  Request templates have a pool of their own
(template_threads threads, as many sandbox children), so a request without one never queues behind a
slow one; a client (its address) has at most max_template_renders_per_client of them in flight (429
beyond), and at most max_pending_template_renders wait in all (503 beyond).
"""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from roofline.entrypoints.openai.serving_engine import APIError, bad_request, server_tokenizer
from roofline.entrypoints.openai.template_sandbox import SandboxedTemplateRenderer, TemplateRenderError
from roofline.model_executor.loader.tokenizer_snapshot import as_transformers_tokenizer

CHARS_MARGIN = 4  # normalization can merge characters; never refuse a text that could fit


def _longest_entry(tokenizer: Any) -> int:
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=64) or 64
    except Exception:
        return 64


class ServerTokenizer:
    def __init__(self, tokenizer: Any, max_model_len: int, *, trust_request_chat_template: bool = False,
                 template_timeout_s: float = 2.0, threads: int = 2, template_threads: int = 2,
                 max_template_renders_per_client: int = 2, max_pending_template_renders: int = 64,
                 chat_template: Optional[str] = None) -> None:
        if tokenizer is not None:  # a tokenizer snapshot loads transformers' class now, for the chats it does
            as_transformers_tokenizer(tokenizer)  # not render itself: no request waits for that import
        self.base = tokenizer
        self.chat_template = chat_template  # the server's --chat-template (trusted), else the model's own
        self.loop = server_tokenizer(tokenizer)  # the event loop's own copy, for short decodes (logprob tokens)
        self.max_model_len = max_model_len
        self.trust_request_chat_template = trust_request_chat_template
        self.max_chars = max_model_len * _longest_entry(tokenizer) * CHARS_MARGIN if tokenizer is not None else 0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="roofline-tokenizer")
        self._local = threading.local()
        self.renderer = self._template_pool = None
        if trust_request_chat_template:
            self.renderer = SandboxedTemplateRenderer(timeout_s=template_timeout_s, max_chars=self.max_chars or (1 << 20),
                                                      children=template_threads)
            self._template_pool = ThreadPoolExecutor(max_workers=template_threads,
                                                     thread_name_prefix="roofline-template")
        self.max_template_renders_per_client = max_template_renders_per_client
        self.max_pending_template_renders = max_pending_template_renders
        self._renders_by_client: dict[str, int] = {}  # in flight (queued or rendering), on the event loop only

    # ---- per-thread tokenizer -------------------------------------------------------------------
    def _tok(self) -> Any:
        tok = getattr(self._local, "tok", None)
        if tok is None:
            try:
                tok = copy.deepcopy(self.base)
            except Exception:
                tok = self.base
            self._local.tok = tok
        return tok

    async def _run(self, fn, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def check_length(self, text: str, field: str) -> None:
        """400 for a text that cannot fit max_model_len tokens, without tokenizing it."""
        if self.max_chars and len(text) > self.max_chars:
            raise bad_request(f"{field} of {len(text)} characters cannot fit max_model_len ({self.max_model_len} "
                              "tokens)", param=field, code="context_length_exceeded")

    # ---- encoding ---------------------------------------------------------------------------------
    async def encode(self, text: str, *, add_special_tokens: bool = True, field: str = "prompt",
                     bounded: bool = True) -> list[int]:
        """Token ids of text.  bounded: refuse texts that cannot fit max_model_len first."""
        if bounded:
            self.check_length(text, field)
        try:
            return await self._run(lambda: self._tok().encode(text, add_special_tokens=add_special_tokens))
        except APIError:
            raise
        except Exception as e:
            raise bad_request(f"cannot tokenize {field}: {type(e).__name__}: {e}", param=field)

    async def decode(self, ids: list[int]) -> str:
        return await self._run(lambda: self._tok().decode(ids))

    async def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return await self._run(lambda: self._tok().convert_ids_to_tokens(ids))

    # ---- chat templates ---------------------------------------------------------------------------
    async def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                          continue_final_message: bool = False, tools: Any = None,
                          chat_template: Optional[str] = None, kwargs: Optional[dict] = None,
                          client: str = "") -> str:
        """client: who sent the request (its address), for the cap on request templates in flight."""
        if chat_template is not None:
            return await self._render_request_template(messages, chat_template, add_generation_prompt,
                                                       continue_final_message, tools, kwargs, client)
        extra = dict(kwargs or {})
        if tools:
            extra["tools"] = tools
        if continue_final_message:
            extra["continue_final_message"] = True

        def render() -> str:
            return self._tok().apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                   chat_template=self.chat_template, **extra)
        try:
            return await self._run(render)
        except Exception as e:
            raise bad_request(f"could not apply the chat template: {type(e).__name__}: {e}", param="messages")

    async def _render_request_template(self, messages, template, add_generation_prompt, continue_final_message,
                                       tools, kwargs, client) -> str:
        if self.renderer is None:
            raise bad_request("request-supplied chat templates are disabled on this server "
                              "(start it with --trust-request-chat-template to allow them)", param="chat_template")
        mine = self._renders_by_client.get(client, 0)
        if mine >= self.max_template_renders_per_client:
            raise APIError(429, f"too many chat_template renders in flight from this client (at most "
                                f"{self.max_template_renders_per_client}); retry when one has finished",
                           "rate_limit_error", "chat_template", "too_many_template_renders")
        if sum(self._renders_by_client.values()) >= self.max_pending_template_renders:
            raise APIError(503, "the server is busy rendering request chat templates; retry later", "server_busy",
                           "chat_template", "template_queue_full", headers={"Retry-After": "1"})
        self._renders_by_client[client] = mine + 1
        try:
            return await self._render_in_sandbox(messages, template, add_generation_prompt, continue_final_message,
                                                 tools, kwargs)
        finally:
            left = self._renders_by_client[client] - 1
            if left:
                self._renders_by_client[client] = left
            else:
                del self._renders_by_client[client]

    async def _render_in_sandbox(self, messages, template, add_generation_prompt, continue_final_message,
                                 tools, kwargs) -> str:
        variables = dict(kwargs or {})
        variables.update(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools)
        for name, value in (getattr(self.base, "special_tokens_map", None) or {}).items():
            if isinstance(value, str):
                variables[name] = value
        try:
            text = await asyncio.get_running_loop().run_in_executor(self._template_pool, self.renderer.render,
                                                                    template, variables)
        except TemplateRenderError as e:
            raise bad_request(str(e), param="chat_template")
        if continue_final_message and messages:
            # keep the text up to the end of the final message's content, as transformers does
            last = messages[-1].get("content") or ""
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[: cut + len(last)]
        return text

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.renderer is not None:
            self._template_pool.shutdown(wait=False, cancel_futures=True)
            self.renderer.close()
