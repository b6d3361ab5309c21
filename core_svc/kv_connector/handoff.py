"""The GrpcConnector's HANDOFF: the JSON object a producer's finished request carries (its
kv_transfer_params, NixlConnector's keys and ours) and a consumer loads the prompt's KV with.

    {"do_remote_prefill": true, "do_remote_decode": false,
     "remote_engine_id": "<producer engine_id>", "remote_block_ids": [..],
     "remote_host": "<rank 0 host>", "remote_port": <rank 0 port>,
     "remote_addresses": ["host:port", ...one per rank],
     "transfer_id": "<32 hex>", "remote_num_tokens": <prompt len>,
     "lease_expires_at": <unix time>, "tp_size": 1}

The consumer trusts none of it: `parse_handoff` checks every key against the request and this
engine (a failure names the key: "kv_transfer_params.<key>: ..."); the producer's ranks check
the pull again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core_svc.kv_connector.base import InvalidKVTransferParams

_HEX32 = re.compile(r"[0-9a-f]{32}")
_MAX_BLOCK_ID = (1 << 32) - 1  # KvLoad's block ids are uint32
_FLAGS = ("do_remote_prefill", "do_remote_decode")


@dataclass(frozen=True, slots=True)
class Handoff:
    """A checked handoff: what a consumer's KvLoad needs of it."""

    remote_engine_id: str
    remote_block_ids: list[int]
    remote_addresses: list[str]
    transfer_id: str


def make_handoff(
    engine_id: str,
    block_ids: list[int],
    addresses: list[str],
    transfer_id: str,
    num_tokens: int,
    lease_expires_at: float,
) -> dict[str, Any]:
    """The producer's handoff for a finished prompt of `num_tokens` in `block_ids`."""
    host, _, port = addresses[0].rpartition(":")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": block_ids,
        "remote_host": host,
        "remote_port": int(port),
        "remote_addresses": list(addresses),
        "transfer_id": transfer_id,
        "remote_num_tokens": num_tokens,
        "lease_expires_at": lease_expires_at,
        "tp_size": len(addresses),
    }


def flag(params: Mapping[str, Any], key: str) -> bool:
    """do_remote_prefill / do_remote_decode: absent is False, anything but a bool is refused."""
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise _invalid(key, f"must be true or false, got {_short(value)}")
    return value


def check_flags(params: Mapping[str, Any]) -> None:
    for key in _FLAGS:
        flag(params, key)


def parse_handoff(
    params: Mapping[str, Any],
    num_tokens: int,
    block_size: int,
    engine_id: str,
    now: float,
    num_ranks: int = 1,
) -> Handoff:
    """The handoff of a request whose prompt has `num_tokens` tokens, checked for this engine
    (`engine_id`, `block_size`, `num_ranks`: rank i pulls from the producer's rank i) at unix
    time `now`; InvalidKVTransferParams names the key."""
    check_flags(params)
    if _integer(params, "remote_num_tokens") != num_tokens:
        raise _invalid("remote_num_tokens", f"is not the prompt's length ({num_tokens} tokens)")
    block_ids = _block_ids(params, -(-num_tokens // block_size))
    transfer_id = params.get("transfer_id")
    if not isinstance(transfer_id, str) or not _HEX32.fullmatch(transfer_id):
        raise _invalid("transfer_id", "must be 32 lowercase hex digits")
    expires = params.get("lease_expires_at")
    if isinstance(expires, bool) or not isinstance(expires, (int, float)):
        raise _invalid("lease_expires_at", "must be a unix time (a number)")
    if expires <= now:
        raise _invalid("lease_expires_at", "the producer's lease on the KV has ended")
    remote_engine_id = params.get("remote_engine_id")
    if not isinstance(remote_engine_id, str) or not remote_engine_id:
        raise _invalid("remote_engine_id", "must be the producer's engine id (a string)")
    if remote_engine_id == engine_id:
        raise _invalid("remote_engine_id", "is this engine's own id")
    return Handoff(remote_engine_id, block_ids, _addresses(params, num_ranks), transfer_id)


def _block_ids(params: Mapping[str, Any], num_blocks: int) -> list[int]:
    block_ids = params.get("remote_block_ids")
    if not isinstance(block_ids, list) or not all(_is_int(b) for b in block_ids):
        raise _invalid("remote_block_ids", "must be a list of block ids (integers)")
    if len(block_ids) != num_blocks:
        raise _invalid(
            "remote_block_ids", f"holds {len(block_ids)} ids; the prompt fills {num_blocks} blocks"
        )
    if block_ids and (min(block_ids) < 1 or max(block_ids) > _MAX_BLOCK_ID):
        raise _invalid("remote_block_ids", f"ids must be in 1..{_MAX_BLOCK_ID} (0 is no block)")
    if len(set(block_ids)) != len(block_ids):
        raise _invalid("remote_block_ids", "names a block twice")
    return block_ids


def _addresses(params: Mapping[str, Any], num_ranks: int) -> list[str]:
    tp_size = _integer(params, "tp_size")
    if tp_size != num_ranks:
        raise _invalid(
            "tp_size",
            f"the producer has {tp_size} ranks, this engine {num_ranks}; KV moves rank to rank "
            "between engines of equal tensor x pipeline sizes",
        )
    addresses = params.get("remote_addresses")
    if not isinstance(addresses, list) or not addresses:
        raise _invalid("remote_addresses", 'must be a non-empty list of "host:port"')
    for address in addresses:
        if not is_host_port(address):
            raise _invalid("remote_addresses", f'{_short(address)} is not "host:port"')
    if len(addresses) != tp_size:
        raise _invalid("remote_addresses", f"lists {len(addresses)} ranks, tp_size is {tp_size}")
    return list(addresses)


def is_host_port(address: object) -> bool:
    """Whether it is "host:port", with a host and a port in 1..65535 ("[::1]:5" for IPv6)."""
    if not isinstance(address, str):
        return False
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _integer(params: Mapping[str, Any], key: str) -> int:
    value = params.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _invalid(key, f"must be an integer, got {_short(value)}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _invalid(key: str, message: str) -> InvalidKVTransferParams:
    return InvalidKVTransferParams(f"kv_transfer_params.{key}: {message}")
