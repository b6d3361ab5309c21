"""Start-up plumbing the three services share: flags, logging, the gRPC service hosts (health,
reflection, graceful stop), gRPC and HTTP metrics, and the embedded default model.

It imports only `splitserve_contracts`; the services import it, never the other way round.
"""
