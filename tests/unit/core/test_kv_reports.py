"""With several ranks a transfer is done once every rank reported it (vLLM's
KVOutputAggregator), failed when any rank failed it; bytes and seconds add up."""

from __future__ import annotations

from core_svc.executor.kv_reports import KvReports
from splitserve_contracts.output_types import KVConnectorOutput


def test_a_load_is_done_once_every_rank_reported_it() -> None:
    reports = KvReports(2)
    mine = KVConnectorOutput(finished_recving=[4], num_bytes_received=100, recv_seconds=0.1)
    merged = reports.merge(mine)
    assert merged is not None and merged.finished_recving == []  # the other rank is pending
    assert merged.num_bytes_received == 100
    reports.add(KVConnectorOutput(finished_recving=[4], num_bytes_received=100))
    merged = reports.merge(None)
    assert merged is not None and merged.finished_recving == [4]
    assert reports.merge(None) is None


def test_a_load_one_rank_failed_is_failed_with_its_reason() -> None:
    reports = KvReports(2)
    reports.add(KVConnectorOutput(failed_recving=[7], failed_reasons=["PullKv: UNAVAILABLE"]))
    merged = reports.merge(KVConnectorOutput(finished_recving=[7]))
    assert merged is not None
    assert (merged.finished_recving, merged.failed_recving) == ([], [7])
    assert merged.failed_reasons == ["PullKv: UNAVAILABLE"]


def test_a_send_is_done_once_every_rank_served_it() -> None:
    reports = KvReports(3)
    reports.add(KVConnectorOutput(finished_sending=[2, 5]))
    reports.add(KVConnectorOutput(finished_sending=[2]))
    assert reports.merge(KVConnectorOutput(finished_sending=[5])) is None
    merged = reports.merge(KVConnectorOutput(finished_sending=[2]))
    assert merged is not None and merged.finished_sending == [2]
    reports.add(KVConnectorOutput(finished_sending=[5]))
    merged = reports.merge(None)
    assert merged is not None and merged.finished_sending == [5]
