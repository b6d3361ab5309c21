"""What an operator sees of a real frontend<->core pair: the per-request log line
(--enable-log-requests) and a frontend that starts before its core and connects once the core
listens (gRPC's own reconnect backoff and wait_for_ready)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from frontend_svc.engine.core_client import EngineCoreClient
from frontend_svc.engine.request_log import RequestLogger
from splitserve.loopback_ports import free_ports
from tests.contract.test_core_service import (
    MAX_LEN,
    PROMPT,
    CoreHarness,
    collect,
    frontend,
    request,
    run,
)

REQUEST_LOGGER = "frontend_svc.requests"


def finished_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == REQUEST_LOGGER]


def test_log_requests_writes_one_line_per_request_without_the_prompt(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with CoreHarness() as core:
            engine = await frontend(core.addr, tokenizer)
            engine.request_logger = RequestLogger(tokenizer)
            await collect(engine.generate(request("plain", max_tokens=4)))
            await collect(engine.generate(request("fan", n=2, temperature=1.0, max_tokens=3)))
            stream = engine.generate(request("cut", max_tokens=50))
            await anext(stream)
            await stream.aclose()  # the client went away
            await engine.close()

    with caplog.at_level(logging.INFO, logger=REQUEST_LOGGER):
        run(scenario)
    plain, fan, cut = finished_lines(caplog)
    assert plain.startswith(
        f"Finished request plain: prompt_tokens={len(PROMPT)}, output_tokens=4, cached_tokens=0, "
        "finish_reason=length, ttft="
    )
    assert "output_tokens=6" in fan and "finish_reason=length,length" in fan
    assert cut.startswith("Finished request cut:") and "finish_reason=abort" in cut
    assert all("latency=" in line and "prompt=" not in line for line in (plain, fan, cut))


def test_max_log_len_adds_the_prompts_first_characters(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)

    async def scenario() -> None:
        async with CoreHarness() as core:
            engine = await frontend(core.addr, tokenizer)
            engine.request_logger = RequestLogger(tokenizer, max_log_len=9)
            spoken = request("spoken", max_tokens=2)
            spoken = type(spoken)(spoken.request_id, ids, spoken.params, None)
            await collect(engine.generate(spoken))
            await engine.close()

    with caplog.at_level(logging.INFO, logger=REQUEST_LOGGER):
        run(scenario)
    (line,) = finished_lines(caplog)
    assert line.endswith(", prompt='The quick'")


def test_a_frontend_started_before_its_core_connects_once_the_core_listens() -> None:
    (port,) = free_ports(1)

    async def scenario() -> None:
        client = EngineCoreClient(f"127.0.0.1:{port}", max_backoff=0.5)
        connecting = asyncio.create_task(client.connect(timeout=30))
        await asyncio.sleep(1.0)  # the channel fails to connect meanwhile, and retries
        assert not connecting.done()
        async with CoreHarness(port=port):
            info = await connecting
            assert info.max_model_len == MAX_LEN
            await client.close()

    run(scenario)
