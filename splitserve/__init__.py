"""splitserve, the user-facing package: the offline `LLM` API (`from splitserve import LLM,
SamplingParams`), the `splitserve` command (CLI and launcher) and the dashboard generator. The
client commands (`generate`, `bench serve`) live in `splitserve_client`, which also ships alone
without torch.

It sits on top of the import graph: it may import the services (`frontend_svc`, `core_svc`,
`worker_svc`), `splitserve_client`, `splitserve_runtime` and `splitserve_contracts`; nothing
imports it. `import splitserve` loads nothing heavy: `LLM` and `SamplingParams` are imported on
first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.llm import LLM, CompletionOutput, RequestOutput
    from splitserve_contracts.sampling_types import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "SamplingParams":
        from splitserve_contracts.sampling_types import SamplingParams

        return SamplingParams
    if name in ("LLM", "CompletionOutput", "RequestOutput"):
        from splitserve import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
