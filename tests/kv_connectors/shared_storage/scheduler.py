"""The engine core's side of the SharedStorageConnector (see the package docstring).

Metadata (JSON): {"loads": [load], "saves": [save]}, each {"req_handle", "key", "block_ids",
"first_block"}: blocks [first_block:] of the prompt's blocks come from (load) or all of them go
to (save) the files of `key`. The ranks load in start_load_kv and save in wait_for_save of the
step that carries them, and report the handles in that step's output.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from core_svc.kv_connector.base import KVConnectorScheduler
from core_svc.request import Request, RequestStatus
from splitserve_contracts.output_types import KVConnectorOutput

_SAVED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def prompt_key(token_ids: list[int]) -> str:
    """The files' name for a prompt: a hash of its token ids."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]


def done_marker(folder: Path, key: str) -> Path:
    """Written after every rank's file of `key` (worker.py): its presence means loadable."""
    return folder / f"{key}.done"


class SharedStorageScheduler(KVConnectorScheduler):
    """See the module docstring."""

    def _configure(self) -> None:
        path = self.extra_config.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ValueError("kv_connector_extra_config.shared_storage_path must name a folder")
        self.folder = Path(path)
        self.role = self.options.kv_role
        self._pending: dict[str, list[dict[str, Any]]] = {"loads": [], "saves": []}
        self._in_flight: set[int] = set()
        """Handles whose load or save was sent and not reported yet."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self.role == "kv_producer" or request.output_token_ids:
            return 0, False
        key = prompt_key(request.prompt_token_ids)
        if not done_marker(self.folder, key).exists():
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        num_tokens = request.num_prompt_tokens
        self._pending["loads"].append(
            {
                "req_handle": request.req_handle,
                "key": prompt_key(request.prompt_token_ids),
                "block_ids": block_ids[: -(-num_tokens // self.block_size)],
                "first_block": (num_tokens - num_external_tokens) // self.block_size,
            }
        )

    def build_connector_meta(self) -> bytes:
        if not (self._pending["loads"] or self._pending["saves"]):
            return b""
        for item in (*self._pending["loads"], *self._pending["saves"]):
            self._in_flight.add(item["req_handle"])
        meta, self._pending = self._pending, {"loads": [], "saves": []}
        return json.dumps(meta).encode()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        handle = request.req_handle
        loads = self._pending["loads"]
        if any(load["req_handle"] == handle for load in loads):
            self._pending["loads"] = [x for x in loads if x["req_handle"] != handle]
            return False, None  # its load never left
        if handle in self._in_flight:
            return True, None  # freed once the ranks report the load
        if self.role == "kv_consumer" or request.status not in _SAVED or request.pooling_task:
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        prompt_blocks = block_ids[:num_blocks]
        key = prompt_key(request.prompt_token_ids)
        if len(prompt_blocks) < num_blocks or done_marker(self.folder, key).exists():
            return False, None
        save = {"req_handle": handle, "key": key, "block_ids": prompt_blocks, "first_block": 0}
        self._pending["saves"].append(save)
        return True, None  # kept until the ranks saved them

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for handle in (*output.finished_sending, *output.finished_recving, *output.failed_recving):
            self._in_flight.discard(handle)

    def take_expired(self, now: float) -> list[int]:
        return []  # saves and loads end within their step

    def has_pending(self) -> bool:
        return bool(self._pending["loads"] or self._pending["saves"] or self._in_flight)
