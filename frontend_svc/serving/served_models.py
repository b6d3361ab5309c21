"""The models a request may name: the served model and the engine's LoRA adapters (vLLM's
OpenAIServingModels), shared by the OpenAI HTTP API, the public gRPC API and its admin service.

The engine core owns the adapters (every frontend sees the same); this keeps a copy of their
names, refreshed from the core when a request names one it does not know (at most once a second,
concurrent misses sharing one call), when /v1/models is read, and after its own loads and
unloads. Loading and unloading at runtime needs VLLM_ALLOW_RUNTIME_LORA_UPDATING (vLLM's switch)
in the frontend's environment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Protocol

import grpc

from frontend_svc.engine.engine_types import EngineInfo, LoraAdapterInfo
from frontend_svc.errors import (
    EngineUnavailable,
    FrontendError,
    InvalidRequest,
    ModelNotFound,
    NotEnabled,
    check_model,
    shorten,
)
from splitserve_runtime.engine_option_rules import lora_enabled

logger = logging.getLogger(__name__)
RUNTIME_LORA_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
REFRESH_INTERVAL_S = 1.0
CORE_TIMEOUT_S = 10.0
LOAD_TIMEOUT_S = 330.0
"""A load waits for every rank to read the adapter (the core allows them 300 s)."""


def runtime_lora_updating(environ: Mapping[str, str]) -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true" (any case) allows it."""
    return environ.get(RUNTIME_LORA_UPDATING, "0").strip().lower() in ("1", "true")


async def resolve_model(
    models: ServedModels | None,
    requested: str | None,
    served_model_name: str,
    aliases: tuple[str, ...] = (),
) -> str:
    """The LoRA adapter a request's `model` names ("": the served model); ModelNotFound (404)
    for a name this server does not serve (`models` None: it serves no adapters)."""
    if models is None:
        check_model(requested, served_model_name, aliases)
        return ""
    return await models.resolve(requested)


class LoraClient(Protocol):
    """The engine core's adapter calls (core_client.EngineCoreClient)."""

    async def list_lora_adapters(self, timeout: float = ...) -> list[LoraAdapterInfo]: ...

    async def load_lora_adapter(
        self, name: str, path: str, load_inplace: bool, timeout: float
    ) -> LoraAdapterInfo: ...

    async def unload_lora_adapter(self, name: str, timeout: float) -> int: ...


_CORE_ERRORS: dict[grpc.StatusCode, type[FrontendError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.ALREADY_EXISTS: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
}


def _core_error(err: grpc.RpcError) -> FrontendError:
    """The core's refusal as the client's error (its message is about the request)."""
    kind = _CORE_ERRORS.get(err.code())
    if kind is None:
        return EngineUnavailable(
            "the engine core could not load or unload the adapter; retry shortly",
            detail=f"{err.code().name}: {err.details()}",
        )
    return kind(err.details() or err.code().name)


class ServedModels:
    """The served model's name and the engine's adapters; see the module docstring."""

    def __init__(
        self,
        client: LoraClient,
        served_model_name: str,
        info: EngineInfo,
        allow_runtime_updates: bool,
        aliases: tuple[str, ...] = (),
    ) -> None:
        self.client = client
        self.served_model_name = served_model_name
        self.aliases = aliases
        """The served model's other --served-model-name names."""
        self.info = info
        self.allow_runtime_updates = allow_runtime_updates
        self.adapters: dict[str, LoraAdapterInfo] = {}
        self._refreshed_at = float("-inf")
        self._refreshing: asyncio.Future[None] | None = None

    @property
    def has_lora(self) -> bool:
        return lora_enabled(self.info.options.lora)

    async def resolve(self, model: str | None) -> str:
        """The LoRA adapter a request's `model` names ("": the served model); ModelNotFound
        (404) for any other name."""
        if not model or model == self.served_model_name or model in self.aliases:
            return ""
        is_stale = time.monotonic() - self._refreshed_at >= REFRESH_INTERVAL_S
        if self.has_lora and model not in self.adapters and is_stale:
            await self.refresh()
        if model in self.adapters:
            return model
        raise ModelNotFound(
            f"The model `{shorten(model)}` does not exist: this server serves "
            f"`{self.served_model_name}`"
            + (
                f" and the LoRA adapters {', '.join(sorted(self.adapters))}"
                if self.adapters
                else ""
            )
        )

    async def refresh(self) -> None:
        """Fetch the adapters from the core (concurrent calls share one fetch)."""
        if not self.has_lora:
            return
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._fetch())
        refreshing = self._refreshing
        try:
            await asyncio.shield(refreshing)
        finally:
            if self._refreshing is refreshing and refreshing.done():
                self._refreshing = None

    async def _fetch(self) -> None:
        try:
            adapters = await self.client.list_lora_adapters(CORE_TIMEOUT_S)
        except grpc.RpcError as err:
            logger.warning("could not list the LoRA adapters: %s", err.code().name)
            return
        self.adapters = {a.name: a for a in adapters}
        self._refreshed_at = time.monotonic()

    def _check_updatable(self) -> None:
        if not self.allow_runtime_updates:
            raise NotEnabled(
                "loading and unloading LoRA adapters at runtime is off; start the frontend "
                f"with {RUNTIME_LORA_UPDATING}=True in its environment"
            )
        if not self.has_lora:
            raise NotEnabled("LoRA is off: start the engine with --enable-lora")

    async def load(self, name: str, path: str, load_inplace: bool) -> LoraAdapterInfo:
        """Load an adapter on the engine (vLLM's /v1/load_lora_adapter)."""
        self._check_updatable()
        if not name or not path:
            raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.")
        try:
            adapter = await self.client.load_lora_adapter(name, path, load_inplace, LOAD_TIMEOUT_S)
        except grpc.RpcError as err:
            raise _core_error(err) from None
        self.adapters[adapter.name] = adapter
        return adapter

    async def unload(self, name: str) -> int:
        """Unload an adapter (vLLM's /v1/unload_lora_adapter); the requests still running it
        finish with it."""
        self._check_updatable()
        if not name:
            raise InvalidRequest("'lora_name' needs to be provided to unload a LoRA adapter.")
        try:
            num_requests = await self.client.unload_lora_adapter(name, CORE_TIMEOUT_S)
        except grpc.RpcError as err:
            raise _core_error(err) from None
        finally:
            self.adapters.pop(name, None)
        return num_requests
