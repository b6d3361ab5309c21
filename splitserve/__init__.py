"""splitserve, the user-facing package: the `splitserve` command (CLI and launcher) and the
dashboard generator; the offline `LLM` API joins it. The client commands (`generate`,
`bench serve`) live in `splitserve_client`, which also ships alone without torch.

It sits on top of the import graph: it may import the services (`frontend_svc`, `core_svc`,
`worker_svc`), `splitserve_client`, `splitserve_runtime` and `splitserve_contracts`; nothing
imports it.
"""
