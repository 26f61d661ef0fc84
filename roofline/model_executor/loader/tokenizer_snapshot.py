"""A tokenizer read without importing transformers: the GGUF metadata cache's tokenizer, as transformers holds it.

Importing transformers costs most of a second (its import table scans every model it ships), which is
most of what `LLM()` spends beyond torch and the weights.  The text-to-ids work itself is the Rust
`tokenizers` library's, which imports in milliseconds.  So when source.gguf_metadata_dir saves a GGUF
file's tokenizer, it also saves a snapshot of that tokenizer *as transformers' class holds it once loaded*
(write_snapshot): the backend tokenizer's own serialization, after transformers has added its special
tokens and set truncation, padding and special-token splitting as its `encode` uses them, plus the values
transformers derives (the special tokens and their ids, the chat template).  TokenizerSnapshot serves
from that:

- encode, decode, convert_ids_to_tokens, convert_tokens_to_ids, get_vocab, len, the special tokens and
  their ids, chat_template: the same calls transformers' TokenizersBackend makes on the same backend state,
  so the same results (tests/model_executor/test_tokenizer_snapshot.py checks them against it);
- apply_chat_template for a plain conversation rendered to text (apply_chat_template's docstring): the
  model's template in the environment transformers renders it in (roofline/chat_template_env.py) with the
  variables transformers passes; checked against transformers on several templates;
- everything else (other conversations, batch calls, options it does not take): transformers' own class,
  loaded from the same directory on first use (`transformers_tokenizer()`), so nothing behaves differently.

Only tokenizers of class TokenizersBackend without decode clean-up get a snapshot; any other directory
loads through transformers as before.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Optional

SNAPSHOT_FILE = "roofline-tokenizer.json"  # the backend tokenizer as transformers holds it
STATE_FILE = "roofline-tokenizer-state.json"  # what transformers derives from its config
SNAPSHOT_VERSION = 1
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers copies these into each other
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def write_snapshot(tokenizer: Any, directory: str) -> bool:
    """Save `tokenizer` (loaded by transformers from `directory`) as a snapshot in `directory`; False, writing
    nothing, for a tokenizer a snapshot cannot stand in for."""
    if type(tokenizer).__name__ != "TokenizersBackend" or tokenizer.clean_up_tokenization_spaces:
        return False
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.no_truncation()  # what encode() sets for a call without truncation or padding
    backend.no_padding()
    state = {
        "version": SNAPSHOT_VERSION,
        "special_tokens": {name: getattr(tokenizer, name) for name in _SPECIAL},
        "special_token_ids": {name: getattr(tokenizer, name + "_id") for name in _SPECIAL},
        "all_special_ids": list(tokenizer.all_special_ids),
        "split_special_tokens": bool(tokenizer.split_special_tokens),
        "chat_template": tokenizer.chat_template,
        "vocab_size": int(tokenizer.vocab_size),
    }
    with open(os.path.join(directory, SNAPSHOT_FILE), "w", encoding="utf-8") as f:
        f.write(backend.to_str())
    with open(os.path.join(directory, STATE_FILE), "w", encoding="utf-8") as f:
        json.dump(state, f)
    return True


def has_snapshot(directory: str) -> bool:
    return all(os.path.exists(os.path.join(directory, f)) for f in (SNAPSHOT_FILE, STATE_FILE))


def _special_token(name: str, table: str = "special_tokens") -> property:
    """A special token (or its id, table="special_token_ids") as transformers' class gave it."""
    return property(lambda self: self._state[table][name])


class TokenizerSnapshot:
    """The tokenizer saved in `directory` by write_snapshot (module docstring)."""

    def __init__(self, directory: str, name_or_path: Optional[str] = None, *,
                 _copy_of: Optional[TokenizerSnapshot] = None):
        from tokenizers import Tokenizer

        self._dir = directory
        self.name_or_path = name_or_path if name_or_path is not None else directory
        self._full = None  # transformers' class, loaded on first use of something the snapshot does not serve
        self._templates: dict[str, Any] = {}  # chat templates compiled here (None: transformers renders it)
        if _copy_of is not None:
            self._backend, self._state = copy.deepcopy(_copy_of._backend), _copy_of._state
            return
        with open(os.path.join(directory, STATE_FILE), encoding="utf-8") as f:
            self._state = json.load(f)
        if self._state.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"tokenizer snapshot in {directory} has version {self._state.get('version')}")
        self._backend = Tokenizer.from_file(os.path.join(directory, SNAPSHOT_FILE))
        self._backend.encode_special_tokens = self._state["split_special_tokens"]

    # ---- what the snapshot serves ---------------------------------------------------------------
    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.transformers_tokenizer().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        # encode_batch, as transformers calls it: it releases the GIL (a single encode() holds it for the
        # whole text, stalling the server's event loop behind a long prompt) and gives the same ids
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if kwargs or not isinstance(token_ids, (list, tuple)) or not all(type(t) is int for t in token_ids):
            return self.transformers_tokenizer().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            tid = self._backend.token_to_id(tokens)
            return self.unk_token_id if tid is None else tid
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    @property
    def vocab_size(self) -> int:
        return self._state["vocab_size"]

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._state["all_special_ids"])

    @property
    def chat_template(self) -> Any:
        return self._state["chat_template"]

    bos_token, eos_token, unk_token, pad_token = (_special_token(n) for n in ("bos_token", "eos_token", "unk_token",
                                                                           "pad_token"))
    bos_token_id, eos_token_id, unk_token_id, pad_token_id = (_special_token(n, "special_token_ids") for n in (
        "bos_token", "eos_token", "unk_token", "pad_token"))

    def apply_chat_template(self, conversation: Any, tools: Any = None, documents: Any = None,
                            chat_template: Optional[str] = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True, **kwargs) -> Any:
        """A plain conversation (messages of string fields, no reasoning fields), rendered to text without tools,
        documents or a continued final message, and with scalar template variables: rendered here, as
        transformers renders it (the same environment, chat_template_env.py, and the same variables: the
        messages, tools=None, documents=None, add_generation_prompt, the special tokens, the variables).
        Anything else, and a template this environment cannot compile (transformers' `{% generation %}`):
        transformers' class."""
        template = chat_template if chat_template is not None else self.chat_template
        plain = (not tokenize and tools is None and documents is None and not continue_final_message
                 and isinstance(template, str) and isinstance(conversation, list) and conversation
                 and all(type(m) is dict and all(type(k) is str and type(v) is str and k not in _REASONING_FIELDS
                                                 for k, v in m.items()) for m in conversation)
                 and all(v is None or type(v) in (str, int, float, bool) for v in kwargs.values()))
        compiled = self._compiled(template) if plain else None
        if compiled is None:
            return self.transformers_tokenizer().apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=tokenize, **kwargs)
        special = {name: tok for name, tok in self._state["special_tokens"].items() if tok is not None}
        return compiled.render(messages=[dict(m) for m in conversation], tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **{**special, **kwargs})

    def _compiled(self, template: str) -> Any:
        """The template compiled in chat_template_env's environment, or None where it does not compile there."""
        cache = self._templates
        if template not in cache:
            import jinja2

            from roofline.chat_template_env import chat_template_environment

            try:
                cache[template] = chat_template_environment().from_string(template)
            except jinja2.TemplateSyntaxError:  # e.g. transformers' own `{% generation %}` tag
                cache[template] = None
        return cache[template]

    # ---- everything else: transformers' own class ------------------------------------------------
    def transformers_tokenizer(self) -> Any:
        """transformers' TokenizersBackend for the same directory (imports transformers on first use)."""
        if self._full is None:
            from transformers import TokenizersBackend

            full = TokenizersBackend.from_pretrained(self._dir)
            full.name_or_path = self.name_or_path
            self._full = full
        return self._full

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_dir", "_full", "_backend", "_state", "_templates"):
            raise AttributeError(name)  # copy / pickle protocols, and a half-built object, stay ours
        return getattr(self.transformers_tokenizer(), name)

    def __deepcopy__(self, memo: dict) -> TokenizerSnapshot:
        """A copy for another thread: its own backend (one must not serve two threads at once)."""
        other = TokenizerSnapshot(self._dir, self.name_or_path, _copy_of=self)
        if self._full is not None:
            other._full = copy.deepcopy(self._full, memo)
        return other

    def __repr__(self) -> str:
        return f"TokenizerSnapshot({self.name_or_path!r}, vocab={len(self)})"


def as_transformers_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer` as a transformers tokenizer object, for libraries that take one (xgrammar)."""
    if isinstance(tokenizer, TokenizerSnapshot):
        return tokenizer.transformers_tokenizer()
    return tokenizer
