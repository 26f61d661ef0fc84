"""The KV connector interface, in two halves, and what a request asks of it (KVTransferParams).  The
connectors themselves (shared storage, P2P) are in roofline/kv_transfer/; core defines what the
Scheduler and the worker call, so that the scheduler never imports a connector.

Scheduler half (`KVConnectorScheduler`, pure Python, lives beside the Scheduler):
  * get_num_new_matched_tokens: how many prompt tokens past those already computed here a remote
    source can supply (whole blocks, keyed by prefix block hash; at least one prompt token is always
    left to compute, as with a prefix-cache hit);
  * update_state_after_alloc: the request's blocks for those tokens are allocated: plan their load;
  * request_finished: a finished prefill; say whether its blocks must be held until they are sent, and
    which kv_transfer_params the client gets back for the decoding engine;
  * build_connector_meta: the step's transfer plan (loads, saves, sends to serve, releases).
The Scheduler keeps the requests waiting for KV and the held blocks (core/kv_transfer_tracker.py).

Worker half (`KVConnectorWorker`, lives beside the KV pool on the worker):
  * register_kv_caches (constructor): the pool's per-layer tensors, shaped by the model's KV cache
    specs (attention/kv_spec.py: K and V, or MLA's one latent), never by the attention modules;
  * start_load_kv: begin the step's loads (synchronous for the shared storage, background threads
    that fill the pool layer by layer for P2P, so the engine keeps computing other requests);
  * save_kv: after the forward, persist the blocks this step computed (shared storage);
  * get_finished: finished sends and receives and failed loads since the last call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from roofline.config import KVTransferConfig
from roofline.core.kv_connector_messages import KVConnectorMetadata, KVConnectorOutput
from roofline.core.request import Request

DEFAULT_SEND_TIMEOUT_S = 120.0  # a held prefill's blocks are freed when nobody took them by then


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


class KVConnectorScheduler(ABC):
    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.send_timeout_s = float(config.extra("send_timeout_s", DEFAULT_SEND_TIMEOUT_S))
        self._meta = KVConnectorMetadata()

    def validate_request(self, params: KVTransferParams) -> None:
        """Raise ValueError (naming the field) for parameters this connector and role cannot serve."""
        if params.do_remote_decode and not self.config.is_producer:
            raise ValueError(f"kv_transfer_params.do_remote_decode needs a producer engine "
                             f"(this one is {self.config.kv_role})")
        if params.do_remote_prefill and not self.config.is_consumer:
            raise ValueError(f"kv_transfer_params.do_remote_prefill needs a consumer engine "
                             f"(this one is {self.config.kv_role})")

    def max_loadable_blocks(self, request: Request) -> int:
        """Full prompt blocks that may come from elsewhere (at least one prompt token is computed here,
        so the engine samples the first output token itself)."""
        return (request.num_prompt_tokens - 1) // self.block_size

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, block_hashes: Sequence[bytes],
                                   num_computed_tokens: int) -> int: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], block_hashes: Sequence[bytes],
                                 first_block: int) -> None: ...

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]: ...

    def on_scheduled(self, request: Request, block_ids: list[int], block_hashes: Sequence[bytes],
                     num_computed_tokens: int, num_new_tokens: int) -> None:
        """A request computes num_new_tokens this step (savers plan the blocks it fills)."""

    def cancel_send(self, request_id: str) -> None:
        """A held request timed out: its blocks are freed and must no longer be served."""
        self._meta.cancelled_sends.append(request_id)

    def build_connector_meta(self) -> Optional[KVConnectorMetadata]:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return None if meta.is_empty() else meta


class KVConnectorWorker(ABC):
    def __init__(self, config: KVTransferConfig, kv_caches: list[Any], block_size: int) -> None:
        self.config = config
        self.kv_caches = kv_caches  # per layer [slots, num_blocks, block_size, heads, head_size]
        self.block_size = block_size

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None: ...

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        """After the step's forward: persist what it computed (connectors that store blocks)."""

    @abstractmethod
    def get_finished(self) -> Optional[KVConnectorOutput]: ...

    def shutdown(self) -> None:
        pass
