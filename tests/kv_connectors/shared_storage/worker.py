"""The ranks' side of the SharedStorageConnector (see the package docstring): each rank writes
and reads its own file per prompt, `<key>.rank<r>.npy`, the blocks' bytes layer by layer as
BlockIO reads them, beside `<key>.rank<r>.json`, the layout they were saved in. A file whose
layout or size does not match is a failed load (the engine core computes the prompt instead)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from splitserve_contracts.output_types import KVConnectorOutput
from tests.kv_connectors.shared_storage.scheduler import done_marker
from worker_svc.kv_connector.base import ConnectorContext, KVConnectorWorker
from worker_svc.kv_connector.block_io import BlockIO
from worker_svc.kv_connector.layout import KvLayout, layout_differences
from worker_svc.kv_connector.reports import Reports


class SharedStorageWorker(KVConnectorWorker):
    """One rank's SharedStorageConnector."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        extra = json.loads(context.options.kv_connector_extra_config or "{}")
        self.folder = Path(extra["shared_storage_path"])
        self.folder.mkdir(parents=True, exist_ok=True)
        self.blocks = BlockIO(context.kv_cache)
        self.reports = Reports()
        self._meta: dict[str, list[dict[str, Any]]] = {}

    def bind_connector_metadata(self, meta: bytes) -> None:
        self._meta = json.loads(meta) if meta else {}

    def start_load_kv(self) -> None:
        for load in self._meta.get("loads", ()):
            started = time.perf_counter()
            try:
                num_bytes = self._load(load)
            except Exception as err:  # noqa: BLE001 (any unreadable file is a failed load)
                self.reports.failed(load["req_handle"], f"{type(err).__name__}: {err}")
            else:
                self.reports.received(load["req_handle"], num_bytes, time.perf_counter() - started)

    def wait_for_save(self) -> None:
        for save in self._meta.get("saves", ()):
            self._save(save)
            self.reports.sent(save["req_handle"])

    def get_finished(self, finished_req_handles: Sequence[int]) -> KVConnectorOutput | None:
        return self.reports.take()

    def clear_connector_metadata(self) -> None:
        self._meta = {}

    def shutdown(self) -> None:
        """Nothing runs between steps."""

    def _files(self, key: str) -> tuple[Path, Path]:
        stem = f"{key}.rank{self.layout.rank}"
        return self.folder / f"{stem}.npy", self.folder / f"{stem}.json"

    def _save(self, save: dict[str, Any]) -> None:
        data, layout = self._files(save["key"])
        ids = [int(i) for i in save["block_ids"]]
        planes = [
            np.frombuffer(self.blocks.read(n, ids), np.uint8)
            for n in range(len(self.blocks.layers))
        ]
        partial = data.with_name(data.name + ".partial")
        with partial.open("wb") as out:
            np.save(out, np.stack(planes))
        os.replace(partial, data)
        layout.write_text(json.dumps(asdict(self.layout)))
        done_marker(self.folder, save["key"]).touch()

    def _load(self, load: dict[str, Any]) -> int:
        data, layout = self._files(load["key"])
        saved = KvLayout(**json.loads(layout.read_text()))
        differences = layout_differences(self.layout, saved)
        if differences:
            raise ValueError(f"saved in another layout: {'; '.join(differences)}")
        ids = [int(i) for i in load["block_ids"]]
        problem = self.blocks.id_problem(ids)
        if problem is not None:
            raise ValueError(problem)
        planes = np.load(data, allow_pickle=False)
        expected = (self.blocks.num_layers, len(ids) * self.blocks.block_bytes)
        if planes.shape != expected or planes.dtype != np.uint8:
            raise ValueError(f"{data.name} holds {planes.shape}, not {expected} bytes")
        first = int(load["first_block"])
        per_block = planes.reshape(self.blocks.num_layers, 2, len(ids), -1)[:, :, first:]
        for layer in range(self.blocks.num_layers):
            self.blocks.write(layer, ids[first:], per_block[layer].tobytes())
        self.blocks.synchronize()
        return int(per_block.nbytes)
