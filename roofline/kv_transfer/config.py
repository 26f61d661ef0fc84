"""KVTransferConfig: which KV connector an engine runs and in what role (`--kv-transfer-config`, vLLM's
JSON shape), and KVTransferParams: what one request asks of it (`kv_transfer_params` in the OpenAI body).

    --kv-transfer-config '{"kv_connector": "P2pConnector", "kv_role": "kv_producer",
                           "kv_ip": "127.0.0.1", "kv_port": 14579,
                           "kv_connector_extra_config": {"send_timeout_s": 120}}'

Roles: kv_producer computes prompts and hands their KV on (a prefill engine), kv_consumer receives KV
(a decode engine), kv_both does both (a colocated engine with a persistent KV tier).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from roofline.json_config import json_fields

CONNECTORS = ("SharedStorageConnector", "P2pConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579  # P2pConnector: where a producer serves its blocks (0: a free port)
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    # a load that fails (source gone, transfer timed out): recompute the prompt here, or fail the request
    kv_load_failure_policy: str = "recompute"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {CONNECTORS}, got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config.kv_load_failure_policy must be one of {LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a port number, got {self.kv_port!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_json(cls, text: str) -> "KVTransferConfig":
        obj = json_fields(text, "kv_transfer_config", set(cls.__dataclass_fields__))
        missing = {"kv_connector", "kv_role"} - set(obj)
        if missing:
            raise ValueError(f"kv_transfer_config needs {sorted(missing)}")
        return cls(**obj)


@dataclass
class KVTransferParams:
    """One request's transfer instructions (vLLM's field names).

    do_remote_decode: this engine prefills; another decodes (hold the KV until it is taken, and
    answer with the parameters the decoder needs).  do_remote_prefill: another engine prefilled this
    prompt; load its KV from remote_host:remote_port (P2P) or the shared storage, keyed by block hash.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: Optional[str] = None
    remote_request_id: Optional[str] = None
    remote_block_ids: list[int] = field(default_factory=list)
    remote_host: Optional[str] = None
    remote_port: Optional[int] = None

    @classmethod
    def parse(cls, obj: Any) -> "KVTransferParams":
        """Validate a request's kv_transfer_params; ValueError names the offending field."""
        if not isinstance(obj, dict):
            raise ValueError("kv_transfer_params must be a JSON object")
        known = set(cls.__dataclass_fields__)
        for key, value in obj.items():
            if key not in known:
                continue  # a newer client's field: ignored, as the API ignores unknown fields
            name = f"kv_transfer_params.{key}"
            if key in ("do_remote_decode", "do_remote_prefill") and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
            if key in ("remote_engine_id", "remote_request_id", "remote_host") and not (
                    value is None or isinstance(value, str)):
                raise ValueError(f"{name} must be a string, got {value!r}")
            if key == "remote_port" and not (value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                             and 0 < value < 65536)):
                raise ValueError(f"{name} must be a port number, got {value!r}")
            if key == "remote_block_ids" and not (isinstance(value, list) and all(
                    isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in value)):
                raise ValueError(f"{name} must be a list of non-negative integers")
        params = cls(**{k: v for k, v in obj.items() if k in known and v is not None})
        if params.do_remote_decode and params.do_remote_prefill:
            raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other")
        return params
