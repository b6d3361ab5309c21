"""The ranks' side of the KV connectors (vLLM's KVConnectorBase_V1, worker role): base.py is the
seam, factory.py builds the configured one, grpc_connector.py is the GrpcConnector."""
