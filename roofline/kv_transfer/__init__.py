"""KV transfer between engines: prefill/decode disaggregation and a persistent KV tier.

  shared_storage.py  SharedStorageConnector: blocks as safetensors files keyed by prefix hash
  p2p.py             P2pConnector: the decoder pulls blocks from the prefiller's pool over TCP

What they implement and what the scheduler keeps lives below them, so that core never imports a
connector:
  roofline/config.py                KVTransferConfig (--kv-transfer-config)
  core/kv_connector.py              the connector interface (scheduler half, worker half) and the
                                    per-request KVTransferParams
  core/kv_connector_messages.py     the per-step transfer plan and the worker's report (msgspec)
  core/kv_transfer_tracker.py       the Scheduler's bookkeeping: requests waiting for KV, held prefills,
                                    failures

This module only picks the connector; importing it loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from roofline.core.kv_connector import KVTransferParams

if TYPE_CHECKING:
    from roofline.config import EngineConfig
    from roofline.core.kv_connector import KVConnectorScheduler, KVConnectorWorker
    from roofline.core.kv_transfer_tracker import KVTransferTracker


def create_scheduler_connector(config: "EngineConfig") -> Optional["KVConnectorScheduler"]:
    kt = config.kv_transfer_config
    if kt is None:
        return None
    bs = config.cache_config.block_size
    if kt.kv_connector == "SharedStorageConnector":
        from roofline.kv_transfer.shared_storage import SharedStorageScheduler

        return SharedStorageScheduler(kt, bs, config)
    from roofline.kv_transfer.p2p import P2pScheduler

    return P2pScheduler(kt, bs)


def create_worker_connector(config: "EngineConfig", kv_caches: list[Any]) -> Optional["KVConnectorWorker"]:
    kt = config.kv_transfer_config
    if kt is None:
        return None
    bs = config.cache_config.block_size
    if kt.kv_connector == "SharedStorageConnector":
        from roofline.kv_transfer.shared_storage import SharedStorageWorker

        return SharedStorageWorker(kt, kv_caches, bs, config)
    from roofline.kv_transfer.p2p import P2pWorker

    return P2pWorker(kt, kv_caches, bs)


def request_params(tracker: Optional["KVTransferTracker"], params: Any, num_completions: int) -> KVTransferParams:
    """A request's kv_transfer_params, validated against this engine's connector (ValueError names the field)."""
    if tracker is None:
        raise ValueError("kv_transfer_params: this engine runs no KV connector (start it with --kv-transfer-config)")
    if num_completions != 1:
        raise ValueError("kv_transfer_params: a disaggregated request must ask for n=1")
    parsed = KVTransferParams.parse(params.kv_transfer_params)
    tracker.connector.validate_request(parsed)
    return parsed


__all__ = ["create_scheduler_connector", "create_worker_connector", "request_params"]
