"""SharedStorageConnector: the trivial second implementation of the KV-connector seam (vLLM's
example connector of the same name), loaded by `kv_connector_module_path`
"tests.kv_connectors.shared_storage" -- proof that the seam is not the GrpcConnector's code.

Every engine with this connector reads and writes one folder
(kv_connector_extra_config.shared_storage_path). A producer (kv_producer, kv_both) saves each
finished prompt's KV blocks there, named by a hash of the prompt's token ids; a consumer
(kv_consumer, kv_both) that receives the same prompt loads them instead of computing it. No
kv_transfer_params: the prompt is the key. This package defines only the registry row, so the
engine core imports no torch: scheduler.py is the core's side, worker.py the ranks'.
"""

from __future__ import annotations

from splitserve_runtime.kv_connector_names import KVConnector

KV_CONNECTOR = KVConnector(
    "SharedStorageConnector",
    "tests.kv_connectors.shared_storage.scheduler:SharedStorageScheduler",
    "tests.kv_connectors.shared_storage.worker:SharedStorageWorker",
    "each finished prompt's KV saved to a shared folder, loaded by any engine given the same "
    "prompt (a test connector)",
)
