"""The engine core's side of the KV connectors (vLLM's KVConnectorBase_V1, scheduler role)."""
