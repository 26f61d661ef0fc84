"""Rendering a chat template that came with a request, in a child process with limits.

A request-supplied Jinja template is code: `{{ 'x' * 10**9 }}` allocates gigabytes and a nested loop
runs for ever, and either would stall the server's event loop or kill it.  They are off unless the
server runs with --trust-request-chat-template; then each one renders here:

- in a child process (`python -m roofline.entrypoints.openai.template_sandbox`) with an address-space
  limit, started on first use and kept for the next request (a renderer keeps a few, each renders one
  template at a time);
- under a wall-clock limit: past it the child is killed (a fresh one starts on the next request) and
  the request gets a 400;
- in Jinja's immutable sandbox, with an output-size limit checked while the template renders.

Messages in and out are msgpack (msgspec) over the child's stdin/stdout, never pickle.  The template
sees what a chat template expects: messages, add_generation_prompt, tools, the model's special tokens,
the caller's extra variables, and the helpers raise_exception, strftime_now and the tojson filter
(roofline/chat_template_env.py).
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import subprocess
import sys
import threading
from typing import Any, Optional

import msgspec

from roofline.chat_template_env import chat_template_environment

logger = logging.getLogger(__name__)

MEMORY_LIMIT_BYTES = 1 << 30  # address space of the child
_HEADER = struct.Struct("<I")


class TemplateRenderError(ValueError):
    """The template failed, or went over its time or output limit (a client error)."""


class RenderJob(msgspec.Struct):
    template: str
    variables: dict[str, Any]
    max_chars: int


class RenderResult(msgspec.Struct):
    text: Optional[str] = None
    error: Optional[str] = None


def _write(stream, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def _read(stream) -> Optional[bytes]:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    data = stream.read(n)
    return data if len(data) == n else None


# ---- the child ----------------------------------------------------------------------------------
def render_limited(env, job: RenderJob) -> RenderResult:
    """Render job.template, stopping once the output passes job.max_chars (the child's own limit)."""
    try:
        template = env.from_string(job.template)
        parts, size = [], 0
        for piece in template.generate(**job.variables):
            size += len(piece)
            if size > job.max_chars:
                return RenderResult(error=f"the chat template's output exceeds {job.max_chars} characters")
            parts.append(piece)
        return RenderResult(text="".join(parts))
    except MemoryError:
        return RenderResult(error="the chat template ran out of memory")
    except Exception as e:
        return RenderResult(error=f"{type(e).__name__}: {e}")


def child_main() -> int:
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ValueError, OSError):  # pragma: no cover - platforms without RLIMIT_AS
        pass
    env = chat_template_environment()
    decoder = msgspec.msgpack.Decoder(RenderJob)
    encoder = msgspec.msgpack.Encoder()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        data = _read(stdin)
        if data is None:
            return 0
        _write(stdout, encoder.encode(render_limited(env, decoder.decode(data))))


# ---- the parent ---------------------------------------------------------------------------------
class _Child:
    """One sandbox child process, started on first use and replaced after it is killed."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None

    def get(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            self.proc = subprocess.Popen([sys.executable, "-m", "roofline.entrypoints.openai.template_sandbox"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         env=env, close_fds=True)
        return self.proc

    def kill(self) -> None:
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=5)
            except Exception:
                pass
            self.proc = None

    def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except Exception:
                pass
        self.kill()


class SandboxedTemplateRenderer:
    """Renders request-supplied chat templates in `children` child processes, up to that many at once
    (thread-safe: a caller takes a free child, and waits for one while all are busy)."""

    def __init__(self, timeout_s: float = 2.0, max_chars: int = 1 << 20, children: int = 1) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._children = [_Child() for _ in range(max(1, children))]
        self._free: "queue.SimpleQueue[_Child]" = queue.SimpleQueue()
        for c in self._children:
            self._free.put(c)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(RenderResult)

    def render(self, template: str, variables: dict[str, Any]) -> str:
        """The rendered text, or TemplateRenderError (failure, time or size limit)."""
        job = self._encoder.encode(RenderJob(template=template, variables=variables, max_chars=self.max_chars))
        child = self._free.get()
        try:
            data = self._exchange(child, job)
        finally:
            self._free.put(child)
        out = self._decoder.decode(data)
        if out.error is not None:
            raise TemplateRenderError(f"the chat template failed: {out.error}")
        return out.text or ""

    def _exchange(self, child: _Child, job: bytes) -> bytes:
        proc = child.get()
        result: dict[str, Any] = {}

        def exchange() -> None:
            try:
                _write(proc.stdin, job)
                result["data"] = _read(proc.stdout)
            except Exception as e:  # the child died
                result["error"] = e

        t = threading.Thread(target=exchange, daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            child.kill()  # unblocks the exchange thread
            t.join(5)
            raise TemplateRenderError(f"the chat template did not render within {self.timeout_s:g} s")
        data = result.get("data")
        if data is None:
            child.kill()
            raise TemplateRenderError("the chat template exhausted the renderer's memory limit")
        return data

    def close(self) -> None:
        for c in self._children:
            c.close()


if __name__ == "__main__":
    sys.exit(child_main())
