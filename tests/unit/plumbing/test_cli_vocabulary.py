"""vLLM's CLI vocabulary: `serve MODEL`, -tp/-pp, underscore spellings, --config YAML, no prefix
guessing, defaults in --help, --version, --dtype aliases, and the service flags `serve` passes on
to the service that owns them (vLLM's flags that change nothing here: test_vllm_flags.py)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from core_svc.assembly import build_engine
from core_svc.config import build_parser as core_parser
from core_svc.config import parse_config as parse_core
from core_svc.engine.engine_inbox import EngineInbox
from core_svc.sched.async_scheduler import AsyncScheduler
from core_svc.worker_pool import ModelFacts
from frontend_svc.config import build_parser as frontend_parser
from frontend_svc.config import parse_config as parse_frontend
from splitserve.cli import main as splitserve_main
from splitserve.launcher import build_parser as serve_parser
from splitserve.launcher import parse_args as parse_serve
from splitserve_client.bench_serve import build_parser as bench_parser
from splitserve_client.generate import build_parser as generate_parser
from splitserve_runtime.flags import FlagParser
from worker_svc.config import build_parser as worker_parser
from worker_svc.config import parse_config as parse_worker

WORKERS = "127.0.0.1:1,127.0.0.1:2"
PARSERS: dict[str, Callable[[], FlagParser]] = {
    "serve": lambda: serve_parser()[0],
    "core": core_parser,
    "frontend": frontend_parser,
    "worker": worker_parser,
    "generate": generate_parser,
    "bench": bench_parser,
}


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def refusal(capsys: pytest.CaptureFixture[str], parse: Callable[[], object]) -> str:
    with pytest.raises(SystemExit) as exited:
        parse()
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_serve_takes_the_model_positionally_like_vllm_serve() -> None:
    args = parse_serve(["/models/llama", "--max-model-len", "128", "-tp", "2"], {})
    assert (args.model, args.tensor_parallel_size) == ("/models/llama", 2)
    assert args.service_flags["core"] == ["--max-model-len", "128", "-tp", "2"]
    assert parse_serve(["--model", "tiny"], {}).model == "tiny"  # `up`'s spelling still works
    assert parse_serve(["tiny", "--model", "tiny"], {}).model == "tiny"


def test_serve_refuses_two_different_models(capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(capsys, lambda: parse_serve(["a/b", "--model", "c/d"], {}))
    assert "named twice" in err


def test_short_and_long_parallel_flags() -> None:
    for argv in (["-tp", "2", "-pp", "1"], ["--tp", "2"], ["--tensor-parallel-size=2"]):
        assert parse_core([*argv, "--worker-addrs", WORKERS], {}).world_size == 2
    assert (
        parse_core(
            ["-pp", "2", "--worker-addrs", WORKERS], {}
        ).options.parallel.pipeline_parallel_size
        == 2
    )


def test_underscore_spellings_are_the_same_flags() -> None:
    config = parse_core(
        ["--worker_addrs", WORKERS, "--max_model_len=99", "--tensor_parallel_size", "2"]
        + ["--no-enable_prefix_caching", "--gpu_memory_utilization", "0.5"],
        {},
    )
    assert (
        config.options.model.max_model_len,
        config.world_size,
        config.options.cache.enable_prefix_caching,
    ) == (99, 2, False)
    assert config.options.cache.gpu_memory_utilization == 0.5
    assert parse_frontend(["--max_logprobs", "3"], {}).max_logprobs == 3
    assert parse_worker(["--torch_threads", "2"], {}).torch_threads == 2
    # A value is a value: underscores in it stay.
    named = parse_core(["--worker-addrs", "h:1", "--served_model_name", "a_b"], {})
    assert named.served_model_name == "a_b"


@pytest.mark.parametrize(
    ("parse", "argv"),
    [
        (parse_core, ["--worker-addrs", WORKERS, "--max-model", "128"]),
        (parse_core, ["--worker-addrs", WORKERS, "--max_model", "128"]),
        (parse_frontend, ["--max-log", "3"]),
        (parse_worker, ["--torch", "2"]),
        (lambda argv, env: parse_serve(argv, env), ["tiny", "--max-model", "128"]),
        (lambda argv, env: generate_parser().parse(argv, env), ["hi", "--max-tok", "3"]),
    ],
)
def test_a_prefix_of_a_flag_is_an_error_never_a_guess(
    parse: Callable[[list[str], dict[str, str]], object],
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = refusal(capsys, lambda: parse(argv, {}))
    assert "unrecognized arguments" in err


def test_config_file_sits_between_command_line_and_environment(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "max_num_seqs: 8\nmax-model-len: 77\nenable_prefix_caching: false\n"
        f"worker_addrs: [{WORKERS}]\ntp: 2\nmetrics-port: -1\n",
    )
    env = {"SPLITSERVE_MAX_NUM_SEQS": "12", "SPLITSERVE_SEED": "5", "SPLITSERVE_MAX_MODEL_LEN": "9"}
    config = parse_core(["--config", path, "--max-num-seqs", "3"], env)
    assert config.options.scheduler.max_num_seqs == 3  # the command line wins over the file
    assert config.options.model.max_model_len == 77  # the file wins over the environment
    assert config.options.model.seed == 5  # the environment fills what neither sets
    assert config.options.cache.enable_prefix_caching is False
    assert config.worker_addrs == WORKERS.split(",") and config.world_size == 2
    assert config.metrics_port is None
    assert parse_core([], {"SPLITSERVE_CONFIG": path}).options.scheduler.max_num_seqs == 8


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_model_length: 5\n", "'max_model_length' is not a flag of splitserve core"),
        ("- a\n- b\n", "expected a mapping"),
        ("enable_prefix_caching: maybe\n", "not a boolean"),
        ("max_num_seqs: [\n", "--config"),
        ("max_num_seqs: 0\n", "must be >= 1"),
        ("kv_transfer_config: true\n", "--kv-transfer-config: expected a JSON object"),
        ("help: true\n", "'help' is not a flag"),
    ],
)
def test_a_bad_config_file_is_refused_saying_where(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, text)
    err = refusal(capsys, lambda: parse_core(["--config", path, "--worker-addrs", WORKERS], {}))
    assert message in err


def test_serve_reads_a_config_file_and_passes_each_flag_to_its_service(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model: tiny\nmax_model_len: 256\nenable-log-requests: true\ndevice: cpu\n"
        "log_format: json\nenforce_eager: true\n",
    )
    args = parse_serve(["--config", path, "--max-num-seqs", "4", "--max_log_len=10"], {})
    assert (args.model, args.log_format) == ("tiny", "json")
    assert args.service_flags == {
        "core": ["--max-model-len=256", "--enforce-eager", "--max-num-seqs", "4"],
        "frontend": ["--enable-log-requests", "--max-log-len=10"],
        "worker": ["--device=cpu"],
    }


def test_the_launcher_keeps_its_own_wiring_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--worker-addrs", "--metrics-port", "--core-addr", "--tls-cert-file"):
        assert flag in refusal(capsys, lambda f=flag: parse_serve(["tiny", f, "x"], {}))


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_shows_every_flags_default(name: str) -> None:
    parser = PARSERS[name]()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.default is argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        text = formatter._expand_help(action)
        assert "(default" in text or "default:" in text, (name, action.option_strings, text)


def test_help_lists_the_services_flags_under_serve(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_serve(["--help"], {})
    out = capsys.readouterr().out
    for text in ("-tp", "--max-num-seqs", "(default: 256)", "--enable-log-requests", "--device"):
        assert text in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert splitserve_main(["--version"]) == 0
    version = capsys.readouterr().out.strip()
    assert version.startswith("splitserve ") and version != "splitserve unknown"
    with pytest.raises(SystemExit) as exited:
        parse_serve(["--version"], {})
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == version


@pytest.mark.parametrize(
    ("given", "served"),
    [("half", "float16"), ("float16", "float16"), ("bfloat16", "bfloat16"), ("float", "float32")]
    + [("float32", "float32"), ("auto", "auto")],
)
def test_dtype_takes_vllms_aliases(given: str, served: str) -> None:
    assert parse_core(["--worker-addrs", "h:1", "--dtype", given], {}).options.model.dtype == served


def test_dtype_refuses_what_vllm_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert "invalid choice" in refusal(
        capsys, lambda: parse_core(["--worker-addrs", "h:1", "--dtype", "fp8"], {})
    )


def test_enforce_eager_and_the_stats_interval_reach_the_core_config() -> None:
    config = parse_core(["--worker-addrs", "h:1", "--enforce-eager"], {})
    assert config.options.model.enforce_eager is True and config.log_stats_interval == 10.0
    assert parse_core(["--worker-addrs", "h:1", "--disable-log-stats"], {}).log_stats_interval == 0
    quiet = parse_core(["--worker-addrs", "h:1", "--log-stats-interval", "0"], {})
    assert quiet.log_stats_interval == 0


def test_the_latency_policy_flags_reach_the_scheduler() -> None:
    argv = ["--worker-addrs", "h:1", "--prefill-token-budget", "128"]
    argv += ["--adaptive-prefill-chunk", "96"]
    config = parse_core([*argv, "--long-prefill-token-threshold", "64"], {})
    facts = ModelFacts("LlamaForCausalLM", 32000, 1024, "bfloat16", "cpu", 64, 1 << 20)
    scheduler = build_engine(config, facts, None, EngineInbox()).scheduler  # type: ignore[arg-type]
    policy = scheduler.prefill_policy
    assert policy.prefill_token_budget == 128
    assert policy.long_prefill_token_threshold == 64
    assert policy.adaptive_chunk == 96
    defaults = parse_core(["--worker-addrs", "h:1"], {})
    assert defaults.options.scheduler.prefill_token_budget == 0, "off by default"
    assert defaults.options.scheduler.adaptive_prefill_chunk == 192, "on by default"
    off = parse_core(["--worker-addrs", "h:1", "--adaptive-prefill-chunk", "0"], {})
    assert off.options.scheduler.adaptive_prefill_chunk == 0


def test_async_scheduling_reaches_the_scheduler_and_is_on_where_it_can_run() -> None:
    """vLLM's default: on, unless pipeline stages (which it cannot serve) or --no-...."""
    facts = ModelFacts("LlamaForCausalLM", 32000, 1024, "bfloat16", "cpu", 64, 1 << 20)
    config = parse_core(["--worker-addrs", "h:1", "--async-scheduling"], {})
    scheduler = build_engine(config, facts, None, EngineInbox()).scheduler  # type: ignore[arg-type]
    assert isinstance(scheduler, AsyncScheduler)
    assert parse_core(["--worker-addrs", "h:1"], {}).options.scheduler.async_scheduling is True
    off = parse_core(["--worker-addrs", "h:1", "--no-async-scheduling"], {})
    assert off.options.scheduler.async_scheduling is False
    scheduler = build_engine(off, facts, None, EngineInbox()).scheduler  # type: ignore[arg-type]
    assert not isinstance(scheduler, AsyncScheduler)
    assert (
        parse_core(
            ["--worker-addrs", "h:1,h:2", "--pp", "2"], {}
        ).options.scheduler.async_scheduling
        is False
    )
    serve = parse_serve(["/models/llama", "--async-scheduling"], {})
    assert serve.service_flags["core"] == ["--async-scheduling"]


def test_async_scheduling_refuses_pipeline_parallelism(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--worker-addrs", "h:1,h:2", "--pp", "2", "--async-scheduling"]
    with pytest.raises(SystemExit):
        parse_core(argv, {})
    said = capsys.readouterr().err  # the rule's words, as a rank refusing LoadModel says them
    assert (
        "--async-scheduling: scheduler.async_scheduling needs parallel.pipeline_parallel_size 1"
        in said
    )


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--speculative-config", "{bad", "not JSON"),
        ("--speculative-config", '{"method": "ngram"}', '"num_speculative_tokens" is required'),
        ("--structured-outputs-config", '{"backend": "xgrammar"}', "not available"),
        ("--kv-events-config", "[1]", ""),
        ("--profiler-config", "{bad", "not JSON"),
    ],
)
def test_a_bad_json_flag_prints_its_error_and_a_pointer_to_help_only(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, says: str
) -> None:
    """Issue 37: a bad --speculative-config printed ~105 lines of usage before its error."""
    err = refusal(capsys, lambda: parse_serve(["tiny", flag, value], {}))
    error, pointer = err.splitlines()
    assert error.startswith(f"splitserve serve: error: argument {flag}: ") and says in error
    assert pointer == "Run `splitserve serve --help` for its flags."
