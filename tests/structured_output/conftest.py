"""The default model's tokenizer and one GrammarCache on it, shared by the structured-output tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_tokenizer():
    from roofline.model_executor.loader.source import load_tokenizer, resolve_source

    return load_tokenizer(resolve_source(None))


@pytest.fixture(scope="session")
def grammar_cache(default_tokenizer):
    from roofline.structured_output.compiler import GrammarCache

    cache = GrammarCache(default_tokenizer, len(default_tokenizer))
    yield cache
    cache.shutdown()
