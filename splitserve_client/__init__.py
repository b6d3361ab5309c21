"""splitserve's Python client of the public gRPC API: `splitserve generate` (stream a completion)
and `splitserve bench serve` (load a running frontend like `vllm bench serve`).

It imports only grpc, `splitserve_contracts` and `splitserve_runtime.flags`, never torch or
transformers, so it also ships alone as the light `splitserve-client` distribution
(clients/python), whose `splitserve` command runs these two commands. The full `splitserve`
command dispatches to the same code.
"""
