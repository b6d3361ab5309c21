"""Prefill/decode disaggregation in one command: `splitserve serve MODEL --pd P:D` starts P prefill
engines and D decode engines (each a whole stack, as `--data-parallel-size P+D` starts them:
splitserve/data_parallel.py) and the Shepherd Model Gateway in smg's PD mode in front
(`--pd-disaggregation --prefill grpc://... --decode grpc://...`).

The gateway sends each request's prefill leg (max_tokens 1) to a prefill engine, whose KV
connector answers with a handoff (kv_transfer_params); then the decode leg, with that handoff,
to a decode engine, which pulls the prompt's KV from the prefill engine's ranks instead of
computing it (docs/deploy.md, "Prefill/decode disaggregation"). What `--pd` adds to the
data-parallel spread of settings: engine i < P gets `--kv-transfer-config` with kv_role
kv_producer and engine_id `prefill-i`, the others kv_consumer and `decode-(i - P)` (also their
cores' --engine-id, the metrics label `engine`); the
connector is GrpcConnector unless the operator's own `--kv-transfer-config` names another (its
kv_connector_extra_config is kept; role and engine id are the launcher's).

Refused: `--pd` with `--data-parallel-size`, with tensor or pipeline parallelism (the launcher
starts engines of one rank each; the connector itself moves KV rank to rank), and with
`--router none` (P/D needs the gateway).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.gateway_process import NO_ROUTER, grpc_url
from splitserve_contracts.engine_options_types import KVTransferOptions
from splitserve_runtime.flags import Flag, flag
from splitserve_runtime.kv_connector_names import kv_transfer_config_dict

CONNECTOR = "GrpcConnector"


@dataclass(frozen=True)
class PdCounts:
    num_prefill: int
    num_decode: int

    def __str__(self) -> str:
        return f"{self.num_prefill}:{self.num_decode}"

    @property
    def num_engines(self) -> int:
        return self.num_prefill + self.num_decode


PREFILL_SILENCE_S = 60
"""smg's --worker-wedge-secs in PD mode (its default: 3). A prefill leg (max_tokens=1) streams
nothing until its prompt is computed, and smg gives up on a leg silent for that bound before it
has measured the engine's prefill rate: on CPU a 2,000-token prompt queued behind others takes
tens of seconds (benchmarks/pd.py), so the first long prompts would fail with 504."""


def pd_counts(text: str) -> PdCounts:
    """`P:D`, both positive (argparse's type)."""
    parts = text.split(":")
    if len(parts) == 2 and all(p.isdigit() and int(p) > 0 for p in parts):
        return PdCounts(int(parts[0]), int(parts[1]))
    raise argparse.ArgumentTypeError(
        f"{text!r} is not P:D (prefill and decode engine counts, each >= 1, e.g. 1:1)"
    )


PD_FLAGS: tuple[Flag, ...] = (
    flag(
        "--pd",
        type=pd_counts,
        default=None,
        help="prefill/decode disaggregation: P:D starts P prefill and D decode engines "
        "(one rank each, KV moved between them by the GrpcConnector) behind the Shepherd "
        "Model Gateway in PD mode",
    ),
)


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse what --pd cannot run; else set --data-parallel-size to P + D engines (the
    data-parallel launch then starts them: splitserve/data_parallel.py)."""
    counts: PdCounts | None = args.pd
    if counts is None:
        return
    if args.data_parallel_size > 1:
        parser.error(
            f"--pd {counts} starts {counts.num_engines} engines itself; leave out "
            "--data-parallel-size"
        )
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    if world > 1:
        parser.error(
            f"--pd starts engines of one rank each; --tensor-parallel-size "
            f"{args.tensor_parallel_size} x --pipeline-parallel-size "
            f"{args.pipeline_parallel_size} is {world} ranks (start such engines with "
            "--kv-transfer-config behind your own gateway: docs/deploy.md)"
        )
    if args.router == NO_ROUTER:
        parser.error("--pd needs the gateway (it sends the prefill and the decode legs); "
                     "choose a --router policy")  # fmt: skip
    args.data_parallel_size = counts.num_engines


def engine_role(counts: PdCounts, index: int) -> tuple[str, str]:
    """(kv_role, engine_id) of engine `index`: the prefill engines first."""
    if index < counts.num_prefill:
        return "kv_producer", f"prefill-{index}"
    return "kv_consumer", f"decode-{index - counts.num_prefill}"


def core_flags(counts: PdCounts, index: int, given: KVTransferOptions | None) -> list[str]:
    """Engine `index`'s --kv-transfer-config (after the operator's flags: it wins) and its id
    as the metrics label `engine` too (`vllm:external_prefix_cache_hits_total{engine="decode-0"}`)."""
    config = kv_transfer_config_dict(given) if given is not None else {}
    role, engine_id = engine_role(counts, index)
    config |= {"kv_connector": config.get("kv_connector") or CONNECTOR, "kv_role": role}
    config["engine_id"] = engine_id
    return ["--kv-transfer-config", json.dumps(config, sort_keys=True), "--engine-id", engine_id]


def gateway_pd_flags(flags: Sequence[str], counts: PdCounts, addrs: Sequence[str]) -> list[str]:
    """The gateway's command line (gateway_flags') in smg's PD mode: the engines as --prefill
    and --decode workers instead of --worker-urls, and PREFILL_SILENCE_S as the wedge bound."""
    start, end = flags.index("--worker-urls"), flags.index("--policy")
    workers = ["--pd-disaggregation"]
    for addr in addrs[: counts.num_prefill]:
        workers += ["--prefill", grpc_url(addr)]
    for addr in addrs[counts.num_prefill :]:
        workers += ["--decode", grpc_url(addr)]
    wedge = ["--worker-wedge-secs", str(PREFILL_SILENCE_S)]
    return [*flags[:start], *workers, *flags[end:], *wedge]
