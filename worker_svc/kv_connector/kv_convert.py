"""kv.v1 protobuf <-> the GrpcConnector's own types (the connector's convert.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from google.protobuf.message import DecodeError

from splitserve_contracts.kv.v1 import kv_transfer_pb2 as kv_pb
from worker_svc.kv_connector.layout import KvLayout
from worker_svc.step_checks import MalformedStep


@dataclass(frozen=True, slots=True)
class KvLoad:
    """Consumer: pull `remote_block_ids` of transfer `transfer_id` into `local_block_ids`."""

    req_handle: int
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    transfer_id: str
    remote_engine_id: str
    remote_addresses: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class KvSend:
    """Producer: serve `block_ids` of request `req_handle` to the pull naming `transfer_id`."""

    req_handle: int
    transfer_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ConnectorMeta:
    """One step's kv.v1.GrpcConnectorMetadata."""

    loads: tuple[KvLoad, ...] = ()
    sends: tuple[KvSend, ...] = ()
    released_transfer_ids: tuple[str, ...] = ()
    cancelled_loads: tuple[int, ...] = ()


NO_META = ConnectorMeta()


def connector_meta_from_bytes(data: bytes) -> ConnectorMeta:
    """The step's metadata (b"": nothing); MalformedStep when it does not parse or a load's
    block lists do not line up."""
    if not data:
        return NO_META
    msg = kv_pb.GrpcConnectorMetadata()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise MalformedStep(f"kv_connector_metadata is no GrpcConnectorMetadata: {e}") from None
    loads = tuple(
        KvLoad(
            load.req_handle,
            tuple(load.local_block_ids),
            tuple(load.remote_block_ids),
            load.transfer_id,
            load.remote_engine_id,
            tuple(load.remote_addresses),
        )
        for load in msg.loads
    )
    for load in loads:
        if len(load.local_block_ids) != len(load.remote_block_ids):
            raise MalformedStep(
                f"kv_connector_metadata: load of request {load.req_handle} has "
                f"{len(load.local_block_ids)} local and {len(load.remote_block_ids)} remote blocks"
            )
    sends = tuple(KvSend(s.req_handle, s.transfer_id, tuple(s.block_ids)) for s in msg.sends)
    return ConnectorMeta(loads, sends, tuple(msg.released_transfer_ids), tuple(msg.cancelled_loads))


def layout_to_proto(layout: KvLayout) -> kv_pb.KvLayout:
    return kv_pb.KvLayout(**{f.name: getattr(layout, f.name) for f in fields(KvLayout)})


def layout_from_proto(msg: kv_pb.KvLayout) -> KvLayout:
    return KvLayout(**{f.name: getattr(msg, f.name) for f in fields(KvLayout)})
