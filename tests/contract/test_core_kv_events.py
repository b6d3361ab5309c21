"""KV-cache events from a real loopback core to the real frontend client: the frontend's mirror
(what it serves gateways) equals the core's prefix cache, is cleared when the core goes away,
and is rebuilt from the restarted core's snapshot; FlushCache's core RPC answers as vLLM does.
The core admits only calls carrying the deployment's internal secret, as `splitserve up` runs
it: the subscription and the reset present it."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from frontend_svc.engine.async_engine import AsyncEngine
from frontend_svc.engine.core_client import EngineCoreClient
from frontend_svc.engine.detokenizer import backend_decoder
from frontend_svc.engine.output_processor import OutputProcessor
from frontend_svc.kv_events.hub import KvEventHub
from splitserve_runtime.channels import ChannelSecurity
from splitserve_runtime.tls import CORE_ROLE
from tests.contract.test_core_service import CoreHarness, collect, frontend_metrics, request, run


def cached(core: CoreHarness) -> set[int]:
    """The core's cached blocks as vLLM's external hashes."""
    pool = core.proc.engine_core.kv_cache_manager.block_pool
    return {int.from_bytes(h[-8:], "big") for h in list(pool.cached_block_hash_to_block)}


async def until(condition: Any, what: str) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


SECRET = "kv-events-internal-secret-0123456789"


def test_the_frontends_mirror_follows_the_core_across_a_restart(tokenizer: Any) -> None:
    async def scenario() -> None:
        core = await CoreHarness(secret=SECRET).__aenter__()
        security = ChannelSecurity(None, CORE_ROLE, SECRET)
        client = EngineCoreClient(core.addr, security=security, subscribe_kv_events=True)
        info = await client.connect(timeout=10)
        hub = KvEventHub(info.options.cache.block_size)
        metrics = frontend_metrics()
        processor = OutputProcessor(backend_decoder(tokenizer), metrics)
        engine = AsyncEngine(client, processor, metrics, max_recovery_seconds=30, kv_events=hub)
        engine.start()
        long_prompt = dataclasses.replace(
            request("a", max_tokens=6), prompt_token_ids=[*range(5, 30)]
        )
        await collect(engine.generate(long_prompt))
        await until(lambda: cached(core) and set(hub.blocks) == cached(core), "the mirror")
        await core.__aexit__()
        await until(lambda: not hub.blocks, "the mirror to clear")
        restarted = await CoreHarness(port=core.port, secret=SECRET).__aenter__()
        try:
            await until(lambda: client.is_connected, "the client to reconnect")
            await collect(engine.generate(request("b", max_tokens=6)))
            await until(
                lambda: cached(restarted) and set(hub.blocks) == cached(restarted),
                "the mirror of the restarted core",
            )
            assert await client.reset_prefix_cache(timeout=5) == 0
            await until(lambda: not hub.blocks, "the flushed cache")
        finally:
            await engine.close()
            await restarted.__aexit__()

    run(scenario)
