"""Loading and unloading LoRA adapters on a running engine (the servicer's LoadLoraAdapter and
UnloadLoraAdapter, and --lora-modules at start-up), on the service's event loop.

A load reserves the name and a fresh id, has every worker rank read the files (each keeps its
shard in its adapter cache; a rank's refusal is the client's one-line error), then names the
adapter. An unload forgets the name at once (new requests naming it are refused) and tells the
busy loop, which lets the requests already added finish with the adapter before the ranks drop
it (core_svc/sched/lora_slots.py): unloading never fails a request in flight.
"""

from __future__ import annotations

import asyncio
import logging

from core_svc.engine.engine_inbox import EngineInbox
from core_svc.lora import LoraAdapter, LoraError, LoraModule, LoraRegistry
from core_svc.worker_pool import WorkerPool

logger = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 300.0
"""How long every rank may take to read an adapter."""
RETIRE_TIMEOUT_S = 30.0


class LoraAdmin:
    """The registry's writer; see the module docstring."""

    def __init__(self, registry: LoraRegistry, pool: WorkerPool, inbox: EngineInbox) -> None:
        self.registry = registry
        self._pool = pool
        self._inbox = inbox

    async def load(
        self, name: str, path: str, base_model_name: str = "", load_inplace: bool = False
    ) -> LoraAdapter:
        """Load `path` under `name` on every rank (LoraError: why not)."""
        registry = self.registry
        lora_id = registry.reserve(name, path, load_inplace)
        try:
            reply = await self._pool.load_lora_adapter(lora_id, path, LOAD_TIMEOUT_S)
        except LoraError as err:
            self._forget(name, lora_id)
            raise LoraError(err.kind, f"Loading lora {name} failed: {err}") from None
        except BaseException:
            self._forget(name, lora_id)
            raise
        adapter = LoraAdapter(name, path, base_model_name, lora_id, reply.max_rank)
        previous = registry.commit(adapter)
        if previous is not None:
            self._inbox.retire_lora(previous.lora_id)
        logger.info(
            "Loaded new LoRA adapter: name '%s', path '%s' (id %d, rank %d, %s)",
            name,
            path,
            lora_id,
            reply.max_rank,
            ", ".join(reply.target_modules),
        )
        return adapter

    def _forget(self, name: str, lora_id: int) -> None:
        """A load failed: the name is free again, ranks that read the files drop them."""
        self.registry.release(name)
        self._inbox.retire_lora(lora_id)

    async def unload(self, name: str) -> int:
        """Forget `name`; returns the requests still running it (they finish with it)."""
        adapter = self.registry.remove(name)
        done = asyncio.wrap_future(self._inbox.retire_lora(adapter.lora_id))
        try:
            num_requests = await asyncio.wait_for(done, RETIRE_TIMEOUT_S) or 0
        except TimeoutError:
            num_requests = 0  # the loop is stuck; the name is gone all the same
        logger.info(
            "Removed LoRA adapter: name '%s' (%d requests finish with it)", name, num_requests
        )
        return num_requests

    async def load_modules(self, modules: list[LoraModule]) -> None:
        """--lora-modules, in order (LoraError names the module that failed)."""
        for module in modules:
            try:
                await self.load(module.name, module.path, module.base_model_name)
            except LoraError as err:
                raise LoraError(
                    err.kind, f"--lora-modules {module.name}={module.path}: {err}"
                ) from None
