"""Start-up plumbing the three services share: flags, logging, the gRPC service hosts (health,
reflection, graceful stop), gRPC and HTTP metrics, termination messages, and model sources
(`--model` resolved alike everywhere: the default SmolLM2, the tiny test model, folders, GGUF
files, Hub ids).

It imports only `splitserve_contracts`; the services import it, never the other way round.
"""
