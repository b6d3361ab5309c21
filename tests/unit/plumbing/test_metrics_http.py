"""The services' metrics endpoint: /metrics in the classic text format, 404 on any other path."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from splitserve_runtime.metrics_http import CLASSIC_TEXT, start_metrics_server


@pytest.fixture
def base_url() -> Iterator[str]:
    registry = CollectorRegistry()
    Counter("vllm:request_success", "finished requests", registry=registry).inc(3)
    server = start_metrics_server(registry, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("path", ["/metrics", "/metrics/", "/metrics?name[]=vllm:x"])
def test_metrics_path_serves_classic_text(base_url: str, path: str) -> None:
    request = urllib.request.Request(
        base_url + path, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"] == CLASSIC_TEXT
        body = reply.read().decode()
    if "name[]" not in path:
        assert "vllm:request_success_total 3.0" in body  # the colon kept, not vllm_...


@pytest.mark.parametrize("path", ["/", "/health", "/metricsx", "/metrics/extra", "/favicon.ico"])
def test_other_paths_are_not_found(base_url: str, path: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base_url + path, timeout=10)
    assert err.value.code == 404
    assert b"vllm:" not in err.value.read()
