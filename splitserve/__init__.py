"""splitserve, the user-facing package: the `splitserve` command (CLI and launcher), the
generate client and the dashboard generator; the offline `LLM` API joins it.

It sits on top of the import graph: it may import the services (`frontend_svc`, `core_svc`,
`worker_svc`), `splitserve_runtime` and `splitserve_contracts`; nothing imports it.
"""
