"""The messages between the two halves of a KV connector (msgspec, no torch): the per-step transfer
plan the scheduler half writes into SchedulerOutput, and what the worker half reports back in
ModelRunnerOutput.  Blocks are named by local block id and by prefix block hash (hex)."""

from __future__ import annotations

from typing import Optional

import msgspec


class RemoteSource(msgspec.Struct, array_like=True):
    """Where a P2P load pulls from: the producer's address and the request whose blocks it holds."""

    host: str
    port: int
    request_id: str
    block_ids: list[int]  # the producer's block ids, in the order of the load's local blocks


class BlockLoad(msgspec.Struct, array_like=True):
    """Fill local blocks block_ids (whose prefix hashes are block_hashes) for request req_id."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[str]
    remote: Optional[RemoteSource] = None  # None: read from the shared storage


class BlockSave(msgspec.Struct, array_like=True):
    """Persist local blocks block_ids under their prefix hashes (computed by this step)."""

    block_ids: list[int]
    block_hashes: list[str]


class KVConnectorMetadata(msgspec.Struct, array_like=True):
    loads: list[BlockLoad] = msgspec.field(default_factory=list)
    saves: list[BlockSave] = msgspec.field(default_factory=list)
    # P2P producer: finished prefills whose blocks are held for a consumer to pull (req -> block ids)
    sends: dict[str, list[int]] = msgspec.field(default_factory=dict)
    cancelled_sends: list[str] = msgspec.field(default_factory=list)  # held too long: no longer served
    # P2P consumer: producers to tell that their held blocks are not needed (all found locally)
    releases: list[RemoteSource] = msgspec.field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.sends or self.cancelled_sends or self.releases)


class KVConnectorOutput(msgspec.Struct, array_like=True):
    finished_sending: list[str] = msgspec.field(default_factory=list)  # held blocks taken: free them
    finished_recving: list[str] = msgspec.field(default_factory=list)  # loads complete
    failed_loads: dict[str, str] = msgspec.field(default_factory=dict)  # req id -> why
    bytes_received: dict[str, int] = msgspec.field(default_factory=dict)  # req id -> KV bytes loaded
    bytes_sent: int = 0

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_loads or self.bytes_received
                    or self.bytes_sent)


def merge_connector_outputs(parts: list[Optional[KVConnectorOutput]]) -> Optional[KVConnectorOutput]:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    out = KVConnectorOutput()
    for p in present:
        out.finished_sending += p.finished_sending
        out.finished_recving += p.finished_recving
        out.failed_loads.update(p.failed_loads)
        out.bytes_received.update(p.bytes_received)
        out.bytes_sent += p.bytes_sent
    return out
