"""KVTransferTracker: the Scheduler's bookkeeping for KV transfer (pure Python, no torch).

  * requests waiting for remote KV (status WAITING_FOR_REMOTE_KVS): their blocks are allocated, but
    neither registered in the prefix cache nor scheduled until the worker reports the load finished;
    a failed load is recomputed here or fails the request (kv_load_failure_policy);
  * finished prefills whose blocks are held until the consumer took them, or until send_timeout_s;
  * a request aborted while its load runs keeps its blocks until the worker is done writing them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.kv_connector import KVConnectorScheduler
from roofline.core.kv_connector_messages import KVConnectorMetadata, KVConnectorOutput
from roofline.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_NORMAL_FINISH = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class KVTransferTracker:
    def __init__(self, connector: KVConnectorScheduler, kv: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv
        self.loading: dict[str, Request] = {}
        self.held: dict[str, tuple[Request, float]] = {}  # request id -> (request, deadline)
        self.failed: dict[str, str] = {}  # requests the engine must fail (load failed, policy "fail")
        self.results: dict[str, dict[str, Any]] = {}  # request id -> kv_transfer_params for its answer
        self.bytes_received = 0
        self.bytes_sent = 0

    @property
    def busy(self) -> bool:
        """Transfers in flight: the engine must keep stepping to see them end."""
        return bool(self.loading or self.held)

    # ---- admission ----------------------------------------------------------------------------
    def try_load(self, req: Request, hits: list, num_hit: int) -> Optional[bool]:
        """For a waiting request after its local prefix hits: None when nothing comes from elsewhere;
        False when the pool is short (try again later); True when its blocks are allocated and it
        now waits for its KV (the caller takes it off the waiting queue)."""
        if req.skip_prefix_cache or req.kv_load_failed:
            return None
        hashes = self.kv.compute_block_hashes(req)
        num_ext = self.connector.get_num_new_matched_tokens(req, hashes, num_hit)
        if num_ext <= 0:
            return None
        if self.kv.allocate_slots(req, num_ext, hits, register=False) is None:
            return False
        bs = self.kv.block_size
        first, last = num_hit // bs, -(-(num_hit + num_ext) // bs)  # a trailing partial block is loaded too
        self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id)[first:last],
                                                hashes[first:last], first)
        req.num_computed_tokens += num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        req.num_loading_tokens = num_ext
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[req.request_id] = req
        return True

    # ---- finishing ------------------------------------------------------------------------------
    def keep_blocks(self, req: Request) -> bool:
        """Called as a request finishes: True when its blocks must outlive it (held for a consumer, or
        still being written by a load); the tracker frees them later."""
        rid = req.request_id
        if rid in self.loading:
            return True  # aborted mid-load: freed when the worker reports the load's end
        if req.kv_transfer is None or not req.kv_transfer.do_remote_decode or req.status not in _NORMAL_FINISH:
            return False
        hold, params = self.connector.request_finished(req, self.kv.get_block_ids(rid))
        if params is not None:
            self.results[rid] = params
        if hold:
            self.held[rid] = (req, time.monotonic() + self.connector.send_timeout_s)
        return hold

    def expire_holds(self, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        for rid, (req, deadline) in list(self.held.items()):
            if now >= deadline:
                logger.warning("request %s: nobody took its KV within %.0f s; its blocks are freed",
                               rid, self.connector.send_timeout_s)
                del self.held[rid]
                self.connector.cancel_send(rid)
                self.kv.free(req)

    # ---- the worker's report ----------------------------------------------------------------------
    def process_output(self, out: Optional[KVConnectorOutput]) -> tuple[list[Request], list[Request]]:
        """Apply a step's transfer results.  Returns (requests whose KV arrived or will be recomputed:
        back to the waiting queue, requests failed by their load (policy "fail"): to be released)."""
        resumed: list[Request] = []
        ended: list[Request] = []
        if out is None:
            return resumed, ended
        self.bytes_received += sum(out.bytes_received.values())
        self.bytes_sent += out.bytes_sent
        for rid in out.finished_sending:
            entry = self.held.pop(rid, None)
            if entry is not None:
                self.kv.free(entry[0])
        for rid in out.finished_recving:
            req = self.loading.pop(rid, None)
            if req is None:
                continue
            if req.is_finished:  # aborted during the load: now its blocks can go
                self.kv.free(req)
                continue
            req.num_computed_tokens += req.num_loading_tokens
            req.num_cached_tokens += req.num_loading_tokens
            req.num_loading_tokens = 0
            self.kv.register_computed(req, req.num_computed_tokens)
            if req.kv_transfer is not None:
                req.kv_transfer.do_remote_prefill = False  # taken: a recompute after preemption loads no more
            req.status = RequestStatus.WAITING
            resumed.append(req)
        for rid, error in out.failed_loads.items():
            req = self.loading.pop(rid, None)
            if req is None:
                continue
            self.kv.free(req)  # the loaded blocks were never registered: nothing stale stays cached
            req.num_loading_tokens = 0
            if req.is_finished:
                continue
            req.num_computed_tokens = 0
            req.num_cached_tokens = -1
            if self.connector.config.kv_load_failure_policy == "recompute":
                logger.warning("request %s: KV load failed (%s); recomputing its prompt here", rid, error)
                req.kv_load_failed = True
                req.status = RequestStatus.WAITING
                resumed.append(req)
            else:
                req.status = RequestStatus.FINISHED_ERROR
                self.failed[rid] = f"KV transfer failed: {error}"
                ended.append(req)
        return resumed, ended

    def on_scheduled(self, req: Request, num_computed_tokens: int, num_new_tokens: int) -> None:
        self.connector.on_scheduled(req, self.kv.get_block_ids(req.request_id), self.kv.compute_block_hashes(req),
                                    num_computed_tokens, num_new_tokens)

    def build_meta(self) -> Optional[KVConnectorMetadata]:
        return self.connector.build_connector_meta()

    def take_failed(self) -> dict[str, str]:
        failed, self.failed = self.failed, {}
        return failed

    def take_result(self, request_id: str) -> Optional[dict[str, Any]]:
        return self.results.pop(request_id, None)
