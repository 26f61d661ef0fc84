"""A model's HF config as plain values (ConfigSnapshot): what transformers' config class resolves from a
config.json, readable without importing transformers.

Importing the first transformers config class costs about a second on a 2-core machine
(torch.distributed.tensor, sympy and the import table of every model transformers ships), in every process
that reads a config: the engine, each worker rank, the engine-core process. So the engine reads configs
through this module:
- snapshot(config) writes down every attribute a resolved `PretrainedConfig` exposes: its fields, the
  class's plain attributes (model_type, attribute_map, ...), the aliases of its attribute_map, its
  properties and its sub-configs (recursively), with `to_dict()` and `get_text_config()` as they were.
- ConfigSnapshot answers attribute reads with those values (an attribute the config lacks raises
  AttributeError, so `getattr(config, name, default)` behaves as on the real config), `to_dict()`,
  `get_text_config()` and the wire form that worker processes receive.
- load_config_dir(path) is the one way the engine reads a config.json: a per-machine cache entry keyed by
  the file (path, size, mtime, content hash), the transformers version and SNAPSHOT_VERSION; on a miss,
  transformers' AutoConfig reads it once and the snapshot is cached.  Every load, hit or miss, returns a
  ConfigSnapshot, so the engine sees one kind of config.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1
_SKIPPED = frozenset({
    "per_layer_config",  # a view object over the config itself (transformers' heterogeneity support)
    "torch_dtype", "use_return_dict",  # deprecated aliases of dtype / return_dict: reading them warns
})


class ConfigSnapshot:
    """The attribute values of a resolved transformers config (see the module docstring)."""

    def __init__(self, values: dict[str, Any], as_dict: dict[str, Any], class_name: str,
                 text_config: Optional["ConfigSnapshot"] = None) -> None:
        self.__dict__.update(values)
        # as_dict: the config's to_dict() (its own value forms: dtype as a string, transformers_version);
        # the attribute values it was taken from tell to_dict() which keys were set since
        taken_from = {k: copy.deepcopy(values[k]) for k in as_dict if k in values}
        object.__setattr__(self, "_snapshot_meta", (as_dict, taken_from, class_name, text_config))

    def to_dict(self) -> dict[str, Any]:
        """The config's to_dict(), with any attribute set since in its new value."""
        as_dict, taken_from, _, _ = self._snapshot_meta
        out = copy.deepcopy(as_dict)
        for k, was in taken_from.items():
            now = getattr(self, k, was)
            if not _same_value(now, was):
                if isinstance(now, ConfigSnapshot):  # a sub-config, in to_dict()'s form for one
                    now = {key: v for key, v in now.to_dict().items() if key != "transformers_version"}
                out[k] = copy.deepcopy(now)
        return out

    def save_pretrained(self, directory: str) -> None:
        """config.json in `directory`, as transformers writes it (every to_dict() key)."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    def get_text_config(self, *args, **kwargs) -> "ConfigSnapshot":
        return self._snapshot_meta[3] or self

    @property
    def config_class(self) -> str:
        """The transformers class the values came from (e.g. "LlamaConfig")."""
        return self._snapshot_meta[2]

    def __repr__(self) -> str:
        return f"ConfigSnapshot[{self.config_class}]({json.dumps(self.to_dict(), default=str, sort_keys=True)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConfigSnapshot) and self.to_wire() == other.to_wire()

    __hash__ = None  # mutable, like transformers' configs

    # ---- the wire/cache form: JSON with tagged values ------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        _, _, class_name, text = self._snapshot_meta
        values = {k: v for k, v in vars(self).items() if k != "_snapshot_meta"}
        return {"class": class_name, "as_dict": _encode(self.to_dict()), "values": _encode(values),
                "text_config": text.to_wire() if text is not None else None}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "ConfigSnapshot":
        text = cls.from_wire(d["text_config"]) if d.get("text_config") else None
        return cls(_decode(d["values"]), _decode(d["as_dict"]), d["class"], text)

    def to_json(self) -> str:
        return json.dumps(self.to_wire())

    @classmethod
    def from_json(cls, s: str) -> "ConfigSnapshot":
        return cls.from_wire(json.loads(s))


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, ConfigSnapshot) or isinstance(b, ConfigSnapshot):
        return a == b
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _is_config(value: Any) -> bool:
    return hasattr(value, "to_dict") and hasattr(value, "model_type") and hasattr(value, "to_json_string")


def snapshot(config: Any) -> ConfigSnapshot:
    """A ConfigSnapshot of a transformers config (every attribute it exposes; see the module docstring)."""
    if isinstance(config, ConfigSnapshot):
        return config
    values: dict[str, Any] = {}
    names = set(vars(config)) | set(getattr(type(config), "attribute_map", {}) or {})
    for klass in type(config).__mro__:
        names.update(n for n in vars(klass) if not n.startswith("__"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(names - _SKIPPED):
            try:
                value = getattr(config, name)
            except Exception:  # a property that does not apply to this config (raises on read)
                continue
            if callable(value):
                continue  # methods (and classes)
            try:
                values[name] = _snapshot_value(value)
            except TypeError:
                continue  # not plain data (e.g. a helper object): not part of what the engine reads
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ConfigSnapshot(values, config.to_dict(), type(config).__name__,
                          None if text is config else snapshot(text))


def _snapshot_value(value: Any) -> Any:
    if _is_config(value):
        return snapshot(value)
    _encode(value)  # raises TypeError when the value is not plain data
    return copy.deepcopy(value)


# Tagged JSON: tuples, sets, non-string dict keys, torch dtypes and sub-configs survive the round trip.
def _encode(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, tuple):
        return {"__tuple__": [_encode(x) for x in v]}
    if isinstance(v, (set, frozenset)):
        return {"__set__": [_encode(x) for x in sorted(v, key=repr)], "frozen": isinstance(v, frozenset)}
    if isinstance(v, dict):
        return {"__dict__": [[_encode(k), _encode(x)] for k, x in v.items()]}
    if isinstance(v, ConfigSnapshot):
        return {"__config__": v.to_wire()}
    if type(v).__module__ == "torch" and type(v).__name__ == "dtype":
        return {"__dtype__": str(v).removeprefix("torch.")}
    raise TypeError(f"{type(v).__name__} is not plain config data")


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if not isinstance(v, dict):
        return v
    if "__tuple__" in v:
        return tuple(_decode(x) for x in v["__tuple__"])
    if "__set__" in v:
        items = [_decode(x) for x in v["__set__"]]
        return frozenset(items) if v["frozen"] else set(items)
    if "__dict__" in v:
        return {_decode(k): _decode(x) for k, x in v["__dict__"]}
    if "__config__" in v:
        return ConfigSnapshot.from_wire(v["__config__"])
    if "__dtype__" in v:
        import torch

        return getattr(torch, v["__dtype__"])
    return {k: _decode(x) for k, x in v.items()}


# ---- reading a config.json -----------------------------------------------------------------------------
def _cache_key(config_json: str) -> str:
    with open(config_json, "rb") as f:
        content = f.read()
    st = os.stat(config_json)
    ident = (f"{os.path.abspath(config_json)}|{st.st_size}|{st.st_mtime_ns}|{hashlib.sha256(content).hexdigest()}|"
             f"{importlib.metadata.version('transformers')}|{SNAPSHOT_VERSION}")
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def load_config_dir(path: str, read: Optional[Callable[[str], Any]] = None) -> ConfigSnapshot:
    """The config of the HF directory `path` (its config.json), as a ConfigSnapshot: from the per-machine
    cache when the file is unchanged, else read by `read` (default: transformers' AutoConfig) and cached."""
    from roofline.config import cache_dir, write_cache_file

    entry = cache_dir() / f"config-{_cache_key(os.path.join(path, 'config.json'))}.json"
    try:
        with open(entry, encoding="utf-8") as f:
            return ConfigSnapshot.from_json(f.read())
    except (OSError, ValueError, KeyError):
        pass  # no entry yet (or an unreadable one): read the file with transformers
    if read is None:
        from transformers import AutoConfig

        read = AutoConfig.from_pretrained
    snap = snapshot(read(path))
    text = snap.to_json()
    if not write_cache_file(entry, lambda tmp: Path(tmp).write_text(text, encoding="utf-8")):
        logger.debug("config snapshot of %s not cached", path)
    return snap
