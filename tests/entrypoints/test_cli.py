"""The `roofline` console script: subcommand dispatch, lazy subcommand imports, `roofline generate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from roofline.entrypoints import cli


@pytest.mark.parametrize("argv, name", [
    (["generate", "--chat", "hi"], "generate"),
    (["--log-level", "DEBUG", "serve", "--port", "1"], "serve"),
    (["--log-level=DEBUG", "plan"], "plan"),
    (["--help"], None),
    ([], None),
])
def test_named_subcommand(argv, name):
    assert cli.named_subcommand(argv) == name


def test_a_named_subcommand_imports_only_its_module():
    code = ("import sys; from roofline.entrypoints.cli import build_parser; "
            "p = build_parser('generate'); "
            "print(sorted(m for m in sys.modules if m.startswith(('roofline.entrypoints.', 'fastapi', 'httpx'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)
    assert "roofline.entrypoints.generate_cmd" in loaded
    assert not {"roofline.entrypoints.serve_cmd", "roofline.entrypoints.router_cmd", "fastapi", "httpx"} & set(loaded)


def test_the_whole_parser_has_every_subcommand():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(cli.SUBCOMMAND_MODULES)
    assert set(cli.build_parser("nonsense")._actions[-1].choices) == set(cli.SUBCOMMAND_MODULES)


def test_generate_chat_answers_and_exits_zero():
    """The README's `roofline generate --chat` through the installed console script: the default model's
    greedy answer, printed before the process ends at once."""
    script = os.path.join(os.path.dirname(sys.executable), "roofline")
    r = subprocess.run([script, "--log-level", "WARNING", "generate", "--chat", "--json", "--max-tokens", "8",
                        "What is the capital of France?"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Paris" in line["text"] and 0 < line["num_tokens"] <= 8
