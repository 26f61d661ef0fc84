"""Every code block under the README's "## Quick start" heading runs as written.

- The server examples (a block naming http://127.0.0.1:8000: curl and the openai client) run against a real
  `roofline serve` on the default model, started here on a free port (the URL rewritten to it). It starts
  with a small KV pool, without the live roofline's start-up probe and with the engine core in a thread of the
  server process (`--no-engine-core-process`: about half the start-up time here; the core process has tests of
  its own), none of which the examples depend on.
- The offline example (a Python block without that URL) runs in this process on the default model. Its
  `LLM()` returns the session's default-model engine (tests/conftest.py `default_llm`, the same model built
  with a 1024-block pool) rather than building a second one: loading the model again costs seconds the suite
  does not have, and what the block then does -- generate and chat -- runs for real.
Any other kind of block fails the test, so nothing enters the quick start untested."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.entrypoints.test_serve_cli import ServeProcess

ROOT = Path(__file__).resolve().parents[2]
URL = "http://127.0.0.1:8000"


def quick_start_blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block between "## Quick start" and the next "## " heading."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```(\w*)\n(.*?)^```", section, flags=re.S | re.M)


BLOCKS = quick_start_blocks()
SERVER_BLOCKS = [(lang, code) for lang, code in BLOCKS if URL in code]
OFFLINE_BLOCKS = [(lang, code) for lang, code in BLOCKS if URL not in code]


def test_quick_start_blocks_are_known_kinds():
    assert len(BLOCKS) >= 3
    assert all(lang == "python" for lang, _ in OFFLINE_BLOCKS), OFFLINE_BLOCKS
    assert all(lang in ("python", "bash") for lang, _ in SERVER_BLOCKS), SERVER_BLOCKS
    assert any("LLM(" in code for _, code in OFFLINE_BLOCKS) and SERVER_BLOCKS


@pytest.fixture(scope="module")
def server():
    """`roofline serve` on the default model. (Started while the offline example ran, it made both slower on a
    2-core machine: two processes' torch threads contend for the cores.)"""
    p = ServeProcess(["--port", "0", "--num-kv-blocks", "256", "--no-step-roofline", "--no-engine-core-process",
                      "--log-stats-interval", "0", "--disable-access-log"])
    yield p
    if p.proc.poll() is None:
        p.proc.kill()
        p.proc.wait()


def _run_python(code: str, namespace: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md (quick start)", "exec"), namespace)
    return out.getvalue()


def test_offline_example(default_llm, monkeypatch):
    import roofline
    from roofline.engine.llm import LLM as RealLLM

    def llm(*args, **kwargs):  # the README's LLM() is the default model: the session's engine of it
        return default_llm if not args and not kwargs else RealLLM(*args, **kwargs)

    monkeypatch.setattr(roofline, "LLM", llm, raising=False)
    for _, code in OFFLINE_BLOCKS:
        printed = _run_python(code, {"__name__": "__readme__"})
        lines = [line for line in printed.splitlines() if line.strip()]
        assert len(lines) >= 2, printed  # the completion and the chat answer
        assert "Paris" in printed  # greedy: SmolLM2 completes "The capital of France is" with Paris


def test_server_examples(server):
    server.wait_ready()
    assert server.model == "SmolLM2-135M-Instruct"  # the name the examples send
    for lang, code in SERVER_BLOCKS:
        code = code.replace(URL, server.url)
        if lang == "python":
            printed = _run_python(code, {"__name__": "__readme__"})
            assert printed.strip(), code
            continue
        if shutil.which("curl") is None and "curl " in code:
            pytest.skip("curl is not installed")
        out = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert answer["choices"][0]["message"]["content"].strip(), answer
