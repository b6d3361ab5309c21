"""KvTransferService under the internal hops' mutual TLS (in-process ranks on loopback): a
rank of the deployment's CA pulls; a peer without a client certificate is refused at the
handshake, and one of another role (the engine core's) by the port's guard."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from splitserve.local_pki import LocalPki
from splitserve_contracts.kv.v1 import kv_transfer_pb2 as kv_pb
from splitserve_contracts.kv.v1 import kv_transfer_pb2_grpc as kv_grpc
from splitserve_runtime.channels import ChannelSecurity, open_channel
from splitserve_runtime.tls import CORE_ROLE, WORKER_ROLE
from tests.fixtures import kv_peers as kv
from worker_svc.kv_connector.kv_convert import layout_to_proto

pytestmark = pytest.mark.timeout(60)
SHAPE = kv.CacheShape()
TRANSFER = "ab" * 16


@pytest.fixture(scope="module")
def pki() -> Iterator[LocalPki]:
    with LocalPki() as made:
        yield made


@pytest.fixture
def producer(pki: LocalPki) -> Iterator[kv.KvPeer]:
    peer = kv.start_peer("producer", SHAPE, tls=pki.files[WORKER_ROLE])
    yield peer
    peer.stop()


def handshake(channel: grpc.Channel) -> kv_pb.KvHandshakeResponse:
    request = kv_pb.KvHandshakeRequest(layout=layout_to_proto(kv.make_layout(SHAPE)))
    return kv_grpc.KvTransferServiceStub(channel).KvHandshake(request, timeout=5)


def test_a_rank_of_the_same_ca_pulls_over_mutual_tls(producer: kv.KvPeer, pki: LocalPki) -> None:
    consumer = kv.start_peer("consumer", SHAPE, tls=pki.files[WORKER_ROLE])
    try:
        kv.fill_blocks(producer.cache, [2, 3])
        producer.step(kv.send_meta(1, TRANSFER, [2, 3]))
        consumer.step(kv.load_meta(4, producer, TRANSFER, [8, 9], [2, 3]))
        consumer.wait_for(lambda r: bool(kv.finished(r, "finished_recving") or kv.failures(r)))
        assert kv.finished(consumer.reports, "finished_recving") == [4], kv.failures(
            consumer.reports
        )
        assert kv.blocks_of(consumer.cache, [8, 9]) == kv.blocks_of(producer.cache, [2, 3])
    finally:
        consumer.stop()


def test_a_peer_without_a_client_certificate_is_refused(producer: kv.KvPeer, pki: LocalPki) -> None:
    ca = Path(pki.files[WORKER_ROLE].ca_file).read_bytes()
    credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    options = [("grpc.ssl_target_name_override", WORKER_ROLE)]
    channel = grpc.secure_channel(producer.address, credentials, options=options)
    with channel, pytest.raises(grpc.RpcError) as info:
        handshake(channel)
    assert isinstance(info.value, grpc.Call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_only_worker_ranks_may_call_it(producer: kv.KvPeer, pki: LocalPki) -> None:
    core = open_channel(producer.address, ChannelSecurity(pki.files[CORE_ROLE], WORKER_ROLE))
    with core, pytest.raises(grpc.RpcError) as info:
        handshake(core)
    assert isinstance(info.value, grpc.Call)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with open_channel(producer.address, ChannelSecurity(pki.files[WORKER_ROLE], WORKER_ROLE)) as ch:
        assert handshake(ch).engine_id == "producer"
