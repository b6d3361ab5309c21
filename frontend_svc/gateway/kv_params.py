"""The gateway contract's KV-transfer fields (smg's P/D, docs/deploy.md): a request's
kv_transfer_params_json, and the connector facts GetServerInfo advertises (smg pairs prefill and
decode engines by them). The checks themselves are frontend_svc/kv_transfer.py's."""

from __future__ import annotations

from smg_grpc_proto import vllm_engine_pb2 as pb

from frontend_svc import kv_transfer
from frontend_svc.engine.engine_types import EngineInfo
from frontend_svc.errors import InvalidRequest

KV_FIELDS = ("kv_transfer_params", "kv_transfer_params_json")
NO_KV_CONNECTOR = (
    "prefill/decode disaggregation (KV transfer) is not supported by an engine without a KV "
    "connector (--kv-transfer-config); this engine cannot honour it; send the request without it"
)
TYPED_KV_PARAMS = (
    "kv_transfer_params: the typed params (Mooncake remote_host/remote_port) are deprecated and "
    "not supported; send the handoff as kv_transfer_params_json (a JSON object)"
)


def kv_transfer_params_json(msg: pb.GenerateRequest, has_kv_connector: bool) -> str:
    """The request's kv_transfer_params_json, checked (a JSON object of at most 64 KiB, n = 1:
    one handoff, one request); "" when unset. Without a KV connector both KV fields are refused
    by name; the typed kv_transfer_params always is."""
    if not has_kv_connector:
        for name in KV_FIELDS:
            if msg.HasField(name):
                raise InvalidRequest(f"{name}: {NO_KV_CONNECTOR}", name)
        return ""
    if msg.HasField("kv_transfer_params"):
        raise InvalidRequest(TYPED_KV_PARAMS, "kv_transfer_params")
    if not msg.HasField("kv_transfer_params_json"):
        return ""
    field = "kv_transfer_params_json"
    text = kv_transfer.params_json_from_text(msg.kv_transfer_params_json, field)
    kv_transfer.check_one_request(max(msg.sampling_params.n, 1), field)
    return text


def kv_connector_facts(info: EngineInfo) -> dict[str, str]:
    """GetServerInfo's kv_connector, kv_role and kv_engine_id, as vLLM's servicer fills them
    from its KVTransferConfig; none without a connector."""
    kv = info.options.kv_transfer
    if kv is None or not kv.kv_connector:
        return {}
    return {"kv_connector": kv.kv_connector, "kv_role": kv.kv_role, "kv_engine_id": kv.kv_engine_id}
