"""GrammarCache: compiles StructuredOutputsParams into xgrammar CompiledGrammars off the engine loop.

A compile runs on a small thread pool (xgrammar releases the GIL while it builds the per-token
masks); the caller gets a concurrent Future at once.  Futures are cached by the params' cache_key,
so the same schema is compiled once, and requests that arrive while it compiles share the one
compile.  A failed compile is cached too (it would fail again) and its exception is a ValueError
naming the field and xgrammar's message; a grammar that allows no first token (no text matches it)
fails the same way.  Thread-safe: the API server validates a request's grammar from its event loop
(waiting on the future there) while the engine thread looks it up.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from roofline.sampling_params import StructuredOutputsParams
from roofline.structured_output.bitmask import bitmask_width

MAX_CACHED_GRAMMARS = 512  # least recently used ones beyond this are dropped
COMPILE_THREADS = 2


def _ebnf_literal(s: str) -> str:
    """A string as an EBNF literal (JSON's escapes are xgrammar's)."""
    return json.dumps(s, ensure_ascii=False)


class GrammarCache:
    def __init__(self, tokenizer: Any, vocab_size: int, threads: int = COMPILE_THREADS) -> None:
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="roofline-grammar")
        self._lock = threading.Lock()
        self._cache: "OrderedDict[tuple, Future]" = OrderedDict()
        self._compiler: Any = None  # xgrammar GrammarCompiler, built on first use (in the pool)
        self._compiler_lock = threading.Lock()
        self.num_compiles = 0  # compiles run (cache misses), failed ones included

    def get(self, params: StructuredOutputsParams) -> Future:
        """The (possibly still running) compile of params; never blocks."""
        key = params.cache_key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, params)
            self._cache[key] = fut
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return fut

    def compile(self, params: StructuredOutputsParams, timeout: Optional[float] = None) -> Any:
        """Blocking form of get(): the CompiledGrammar, or the ValueError of a failed compile."""
        return self.get(params).result(timeout)

    def _xgr_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                from roofline.model_executor.loader.tokenizer_snapshot import as_transformers_tokenizer

                info = xgr.TokenizerInfo.from_huggingface(as_transformers_tokenizer(self.tokenizer),
                                                          vocab_size=self.vocab_size)
                # our own cache holds the results (one entry per key, failures included)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._threads, cache_enabled=False)
            return self._compiler

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._xgr_compiler()
        with self._lock:
            self.num_compiles += 1
        kind = params.kind
        try:
            if kind == "json":
                schema = params.json
                if schema is True:
                    grammar = compiler.compile_builtin_json_grammar()
                else:
                    grammar = compiler.compile_json_schema(json.dumps(schema),
                                                           any_whitespace=not params.disable_any_whitespace)
            elif kind == "json_object":  # OpenAI's json_object: any JSON object (not an array or a scalar)
                grammar = compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                       any_whitespace=not params.disable_any_whitespace)
            elif kind == "regex":
                grammar = compiler.compile_regex(params.regex)
            elif kind == "choice":
                grammar = compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in params.choice))
            else:
                text = params.grammar
                grammar = compiler.compile_grammar(text) if "::=" in text else compiler.compile_lark(text)
        except Exception as e:  # xgrammar raises RuntimeError / its own types with a readable message
            msg = str(e).strip().splitlines()
            detail = msg[0] if msg else type(e).__name__
            if "] " in detail and detail.startswith("["):  # drop xgrammar's "[time] file.cc:line: " prefix
                detail = detail.split(": ", 1)[-1]
            raise ValueError(f"invalid structured_outputs.{kind}: {detail}") from None
        if not self._allows_a_first_token(grammar):
            raise ValueError(f"invalid structured_outputs.{kind}: the constraint can never produce a token "
                             "(no text matches it)")
        return grammar

    def _allows_a_first_token(self, grammar: Any) -> bool:
        """Whether a fresh matcher allows any token (EOS counts: an empty match is a match).  xgrammar
        compiles an unsatisfiable regex or a schema that requires itself without complaint; its first
        mask is then empty."""
        import xgrammar as xgr
        import torch

        mask = torch.zeros((1, bitmask_width(self.vocab_size)), dtype=torch.int32)
        xgr.GrammarMatcher(grammar).fill_next_token_bitmask(mask, 0)
        return bool(mask.any())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
