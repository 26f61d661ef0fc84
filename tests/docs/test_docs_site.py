"""The documentation site (mkdocs.yml, docs/) and the README: the site builds in strict mode (a broken link or
anchor, or a page missing from the nav, fails), the README's test command is the one .ci/run calls, and what
the pages name exists: every `--flag` is one of roofline's CLI flags (or a named tool's), every repository
path is there, every benchmark figure carries its date, machine, command and commit."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md"))
TEXTS = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *PAGES]}
TEST_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m pytest -q"

# flags of other tools that the docs quote
OTHER_TOOLS_FLAGS = {
    "--ignore-eos": "vLLM's benchmark client (W2s)",
    "--backend": "vLLM's benchmark client (W2s)",
    "--engine-core-in-thread": "this repository's pytest option (tests/conftest.py)",
    "--strict": "mkdocs build",
    "--continuous-batching": "transformers serve (the README's feature table)",
    "--head": "ray start (docs/parallelism.md, Ray cluster)",
    "--address": "ray start (docs/parallelism.md, Ray cluster)",
}
# file names of other projects that the docs quote
OTHER_PROJECTS_FILES = {"convert_hf_to_gguf.py": "llama.cpp's converter", "benchmarks/serve": "vLLM's client"}


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _roofline_flags() -> set[str]:
    from roofline.entrypoints.cli import build_parser

    flags: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(build_parser())
    return flags


def test_mkdocs_build_strict(tmp_path):
    """`mkdocs build --strict` into a temporary directory: what .ci/run checks through this test."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                          "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    built = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert {f"{p.stem}/index.html" for p in PAGES if p.stem != "index"} <= built


def test_site_output_is_git_ignored():
    site_dir = re.search(r"^site_dir:\s*(\S+)", (ROOT / "mkdocs.yml").read_text(), re.M).group(1)
    assert f"{site_dir}/" in (ROOT / ".gitignore").read_text().split()


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in ci
    for name in ("README.md", "docs/getting-started.md"):
        assert f"\n{TEST_COMMAND}\n" in TEXTS[name], name
    assert "\nbash scripts/setup.sh && .venv/bin/roofline serve\n" in TEXTS["README.md"]


def test_readme_stays_short():
    assert len(TEXTS["README.md"].splitlines()) <= 180  # what does not fit belongs in docs/


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_flags_exist(name):
    known = _roofline_flags()
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w-])", TEXTS[name]))
    unknown = sorted(f for f in named - known if f not in OTHER_TOOLS_FLAGS)
    assert not unknown, f"{name} names flags no roofline command has: {unknown}"


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], capture_output=True,
                         text=True, cwd=ROOT, check=True)
    return out.stdout.split()


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_paths_exist(name):
    """Inline-code paths (`roofline/cpu/ops.py`, `attention/kv_spec.py`, `llama.py`) name tracked files or
    folders: relative to the repository, or to a folder of it (the docs write `cpu/ops.py` for roofline/cpu/...)."""
    files = _tracked_files()
    dirs = {str(Path(f).parent.as_posix()) for f in files} | {Path(*Path(f).parts[:i]).as_posix()
                                                               for f in files for i in range(1, len(Path(f).parts))}
    names = {Path(f).name for f in files}
    missing = []
    for token in re.findall(r"`([^`\s]+)`", _without_fences(TEXTS[name])):
        token = token.rstrip("/")
        if (token.startswith(("path/", "/", "~", "$", "-", ".venv", "http", "application/"))
                or re.search(r"[*<>$:{}|]|\.\.\.", token) or token in OTHER_PROJECTS_FILES):
            continue
        if "/" in token and re.fullmatch(r"[\w.-]+(/[\w.-]+)+", token):
            ok = any(f == token or f.endswith("/" + token) for f in files) or any(
                d == token or d.endswith("/" + token) for d in dirs)
        elif re.fullmatch(r"[\w-]+\.(py|c|sh)", token):
            ok = token in names
        else:
            continue
        if not ok:
            missing.append(token)
    assert not missing, f"{name} names paths that are not in the repository: {missing}"


def test_every_benchmark_figure_has_its_provenance():
    """Each figure of docs/benchmarks.md sits under a table row giving its date, machine, command and the
    commit that first recorded it (an existing commit)."""
    text = TEXTS["docs/benchmarks.md"]
    figures = text.split("\n## Figures\n", 1)[1]
    entries = re.split(r"^### ", figures, flags=re.M)[1:]
    assert len(entries) >= 20
    for entry in entries:
        title = entry.splitlines()[0]
        rows = [re.split(r"(?<!\\)\|", line)[1:-1] for line in entry.splitlines() if line.startswith("| 2")]
        assert len(rows) == 1 and len(rows[0]) == 4, f"{title}: no | date | machine | command | commit | row"
        date, machine, command, commits = (cell.strip() for cell in rows[0])
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date) and machine and command, title
        assert "\n> " in entry, f"{title}: no quoted figure"
        assert commits.startswith("commit "), title
        for commit in re.findall(r"`([0-9a-f]{7,40})`", commits):
            date = subprocess.run(["git", "log", "-1", "--format=%ad", "--date=short", commit], capture_output=True,
                                  text=True, cwd=ROOT)
            assert date.returncode == 0, f"{title}: unknown commit {commit}"


def test_readme_links_resolve():
    """The README is read on a forge, outside the site: its relative links name files, and headings there."""
    from markdown.extensions.toc import slugify

    for target in re.findall(r"\]\(([^)\s]+)\)", TEXTS["README.md"]):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).is_file(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", _without_fences((ROOT / path).read_text()), re.M)
            assert anchor in {slugify(h, "-") for h in headings}, target
