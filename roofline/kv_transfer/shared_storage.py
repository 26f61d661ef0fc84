"""SharedStorageConnector: KV blocks as safetensors files under a directory (one host, or a filesystem
every engine mounts), one file per block holding that block of every layer, named by the block's
prefix hash.  A producer writes each full prompt block it computes; a consumer loads the blocks of a
prompt that its own prefix cache lacks.  Because files are keyed by content (the chained prefix hash)
and outlive the engines, the directory is also a persistent prefix-cache tier that survives restarts.

Layout:  <shared_storage_path>/<model key>/<hash hex>.safetensors   with tensors "layer.<i>"
         [num_slots, block_size, num_kv_heads, head_size] (the layer's KV cache spec; MLA: one latent slot)
The model key separates checkpoints, dtypes and block sizes, so engines of different models can
share a directory without ever reading each other's blocks.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Optional, Sequence

from roofline.config import KVTransferConfig
from roofline.core.kv_connector import KVConnectorScheduler, KVConnectorWorker
from roofline.core.kv_connector_messages import BlockLoad, BlockSave, KVConnectorMetadata, KVConnectorOutput
from roofline.core.request import Request

logger = logging.getLogger(__name__)


def storage_dir(kt: KVTransferConfig, engine_config: Any) -> str:
    """The directory of this engine's blocks: the shared path plus a key of what makes blocks compatible."""
    root = kt.extra("shared_storage_path", None)
    if not root or not isinstance(root, str):
        raise ValueError("SharedStorageConnector needs kv_connector_extra_config.shared_storage_path (a directory)")
    mc, cc = engine_config.model_config, engine_config.cache_config
    ident = "|".join(str(x) for x in (os.path.abspath(mc.model_path) if mc.model_path else mc.model, mc.gguf_file,
                                      mc.dtype, engine_config.device_config.device.split(":")[0], cc.block_size,
                                      cc.kv_cache_dtype))
    return os.path.join(root, hashlib.sha256(ident.encode()).hexdigest()[:16])


def block_file(directory: str, block_hash_hex: str) -> str:
    return os.path.join(directory, block_hash_hex + ".safetensors")


class SharedStorageScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int, engine_config: Any) -> None:
        super().__init__(config, block_size)
        self.dir = storage_dir(config, engine_config)
        os.makedirs(self.dir, exist_ok=True)
        self._saved: set[str] = set()  # hashes written (or planned this step) by this engine

    def _on_disk(self, h: str) -> bool:
        return os.path.exists(block_file(self.dir, h))

    def get_num_new_matched_tokens(self, request: Request, block_hashes: Sequence[bytes],
                                   num_computed_tokens: int) -> int:
        if not self.config.is_consumer:
            return 0
        first, last = num_computed_tokens // self.block_size, self.max_loadable_blocks(request)
        # a remote prefill promised these blocks: load them all (one missing is a failed transfer);
        # otherwise the storage is a prefix tier: take the run of blocks found on disk
        promised = request.kv_transfer is not None and request.kv_transfer.do_remote_prefill
        n = 0
        for i in range(first, last):
            if not promised and not self._on_disk(block_hashes[i].hex()):
                break
            n += 1
        return n * self.block_size

    def update_state_after_alloc(self, request: Request, block_ids: list[int], block_hashes: Sequence[bytes],
                                 first_block: int) -> None:
        self._meta.loads.append(BlockLoad(request.request_id, list(block_ids), [h.hex() for h in block_hashes]))

    def on_scheduled(self, request: Request, block_ids: list[int], block_hashes: Sequence[bytes],
                     num_computed_tokens: int, num_new_tokens: int) -> None:
        if not self.config.is_producer:
            return
        end = min(num_computed_tokens + num_new_tokens, request.num_prompt_tokens)
        ids, hashes = [], []
        for i in range(num_computed_tokens // self.block_size, end // self.block_size):
            h = block_hashes[i].hex()
            if h in self._saved or self._on_disk(h):
                continue
            self._saved.add(h)
            ids.append(block_ids[i])
            hashes.append(h)
        if ids:
            self._meta.saves.append(BlockSave(ids, hashes))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        full = request.num_prompt_tokens // self.block_size
        return False, {"do_remote_decode": False, "do_remote_prefill": True,
                       "remote_engine_id": self.config.engine_id, "remote_request_id": request.request_id,
                       "remote_block_ids": block_ids[:full], "remote_host": None, "remote_port": None}


class SharedStorageWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, kv_caches: list[Any], block_size: int, engine_config: Any) -> None:
        super().__init__(config, kv_caches, block_size)
        self.dir = storage_dir(config, engine_config)
        os.makedirs(self.dir, exist_ok=True)
        self._out = KVConnectorOutput()

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Synchronous: the files are read into the pool before this step's forward."""
        from safetensors.torch import load_file

        for load in meta.loads:
            nbytes = 0
            try:
                for bid, h in zip(load.block_ids, load.block_hashes):
                    path = block_file(self.dir, h)
                    if not os.path.exists(path):
                        raise FileNotFoundError(f"block {h} is not in the shared storage {self.dir}")
                    tensors = load_file(path)
                    for i, cache in enumerate(self.kv_caches):
                        t = tensors.get(f"layer.{i}")
                        dst = cache[:, bid]
                        if t is None or t.shape != dst.shape or t.dtype != dst.dtype:
                            raise ValueError(f"block file {path} does not match this engine's KV cache at layer {i}")
                        dst.copy_(t)
                        nbytes += t.numel() * t.element_size()
            except Exception as e:
                logger.warning("request %s: loading KV from %s failed: %s", load.req_id, self.dir, e)
                self._out.failed_loads[load.req_id] = f"{type(e).__name__}: {e}"
                continue
            self._out.finished_recving.append(load.req_id)
            self._out.bytes_received[load.req_id] = nbytes

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        """After the forward: write each planned block (all layers) to a temporary file, then rename it,
        so a reader never sees half a block."""
        from safetensors.torch import save_file

        for save in meta.saves:
            for bid, h in zip(save.block_ids, save.block_hashes):
                path = block_file(self.dir, h)
                tmp = f"{path}.{os.getpid()}.tmp"
                tensors = {f"layer.{i}": cache[:, bid].contiguous().cpu() for i, cache in enumerate(self.kv_caches)}
                try:
                    save_file(tensors, tmp)
                    os.replace(tmp, path)
                except OSError as e:  # a full disk costs the tier a block, not the request
                    logger.warning("could not store KV block %s: %s", h, e)
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                    continue
                self._out.bytes_sent += sum(t.numel() * t.element_size() for t in tensors.values())

    def get_finished(self) -> Optional[KVConnectorOutput]:
        out, self._out = self._out, KVConnectorOutput()
        return None if out.is_empty() else out
