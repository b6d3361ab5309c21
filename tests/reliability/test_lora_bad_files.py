"""Corrupt LoRA adapter files (issue 37, item 7): truncated weights, a safetensors header that
claims 2^40 bytes, a header that is not one. A rank refuses each in one line naming the file and
the problem, before safetensors reads or allocates anything; /v1/load_lora_adapter answers 400
with that line (not 503 "retry shortly", which no retry could make true), no worker traceback
reaches the log, the stack goes on serving; an engine started with such an adapter in
--lora-modules stops with the same line. The adapters are made by peft on the tiny model."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.children import LaunchError
from tests.e2e.stack import Stack
from tests.e2e.test_lora import client, post
from tests.fixtures.lora_adapters import make_adapter
from tests.fixtures.ranks import LocalRank
from tests.reliability.probes import PYTHON_INTERNALS
from worker_svc.lora.peft_config import WEIGHTS_FILE, AdapterError
from worker_svc.model_loader.model_load import LoadModelConfig

pytestmark = pytest.mark.slow
TiB = 1 << 40


def _split(data: bytes) -> tuple[dict[str, dict[str, object]], bytes]:
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _join(header: object, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + body


def _join_raw(raw: bytes) -> bytes:
    return len(raw).to_bytes(8, "little") + raw


def _last_tensor(header: dict[str, dict[str, object]]) -> str:
    tensors = [name for name in header if name != "__metadata__"]
    return max(tensors, key=lambda name: header[name]["data_offsets"][1])  # type: ignore[index]


def _claims_a_tebibyte(data: bytes) -> bytes:
    header, body = _split(data)
    header[_last_tensor(header)]["data_offsets"][1] = TiB  # type: ignore[index]
    return _join(header, body)


def _shape_of_a_tebibyte(data: bytes) -> bytes:
    """Offsets inside the file, a shape of 2^40 bytes (safetensors' own check refuses it)."""
    header, body = _split(data)
    header[_last_tensor(header)]["shape"] = [1 << 20, 1 << 18]
    return _join(header, body)


def _backwards_offsets(data: bytes) -> bytes:
    header, body = _split(data)
    header[_last_tensor(header)]["data_offsets"] = [8, 2]
    return _join(header, body)


CASES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "truncated": (lambda d: d[: len(d) * 2 // 3], "of the data, but the file holds"),
    "claims-2^40-bytes": (_claims_a_tebibyte, f"..{TiB} of the data, but the file holds"),
    "header-length-2^40": (
        lambda d: TiB.to_bytes(8, "little") + d[8:],
        f"the header says it is {TiB} bytes long but the file has",
    ),
    "cut-in-the-header": (lambda d: d[:40], "bytes long but the file has 40 bytes"),
    "empty": (lambda d: b"", "the file has 0 bytes, too few for a safetensors header"),
    "header-not-json": (lambda d: (9).to_bytes(8, "little") + b"{not json", "not valid JSON"),
    "header-nested-too-deep": (lambda d: _join_raw(b"[" * 200_000), "not valid JSON"),
    "header-a-list": (lambda d: _join_raw(b"[1, 2]"), "the header is not a JSON object"),
    "backwards-offsets": (_backwards_offsets, "no valid data_offsets"),
    "shape-of-2^40-bytes": (_shape_of_a_tebibyte, "cannot be read: Error while deserializing"),
}


@pytest.fixture(scope="module")
def corrupt(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A good peft adapter ("good") and one folder per case: its config, broken weights."""
    root = tmp_path_factory.mktemp("lora-bad-files")
    good = make_adapter(tiny_model_dir, root / "good", seed=1, rank=4)
    data = (good / WEIGHTS_FILE).read_bytes()
    folders = {"good": good}
    for name, (damage, _) in CASES.items():
        folder = root / name
        shutil.copytree(good, folder)
        (folder / WEIGHTS_FILE).write_bytes(damage(data))
        folders[name] = folder
    return folders


def _assert_names_the_problem(message: str, case: str) -> None:
    assert "\n" not in message and not any(bit in message for bit in PYTHON_INTERNALS), message
    assert WEIGHTS_FILE in message and CASES[case][1] in message, message
    assert "retry" not in message, message


@pytest.fixture(scope="module")
def rank(tiny_model_dir: Path) -> Iterator[LocalRank]:
    rank = LocalRank()
    rank.load(LoadModelConfig.of(str(tiny_model_dir), block_size=16, max_loras=1, max_lora_rank=8))
    rank.init(num_blocks=16)
    yield rank
    rank.close()


@pytest.mark.parametrize("case", CASES)
def test_a_rank_refuses_a_corrupt_weights_file_in_one_line(
    rank: LocalRank, corrupt: dict[str, Path], case: str
) -> None:
    with pytest.raises(AdapterError) as refused:
        rank.worker.read_lora_adapter(3, str(corrupt[case]))
    _assert_names_the_problem(str(refused.value), case)


def test_load_lora_adapter_answers_400_and_the_stack_keeps_serving(
    tiny_model_dir: Path,
    corrupt: dict[str, Path],
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every corrupt folder: 400 naming the file and the problem, twice (a retry cannot help);
    the services log no traceback; the good adapter then loads and serves."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    stack = Stack(tiny_model_dir, core_flags=["--enable-lora", "--max-loras", "1"]).start()
    try:
        for case in CASES:
            for _ in range(2):
                body = {"lora_name": case, "lora_path": str(corrupt[case])}
                status, reply = post(stack, "/v1/load_lora_adapter", body)
                message = json.loads(reply)["error"]["message"]
                assert status == 400 and message.startswith(f"Loading lora {case} failed: "), reply
                _assert_names_the_problem(message, case)
        body = {"lora_name": "good", "lora_path": str(corrupt["good"])}
        assert post(stack, "/v1/load_lora_adapter", body)[0] == 200
        served = client(stack).completions.create(model="good", prompt="hello", max_tokens=4)
        assert served.usage is not None and served.usage.completion_tokens == 4
    finally:
        stack.stop()
    logs = capfd.readouterr().err
    assert "Traceback" not in logs, logs[-4000:]


def test_an_engine_started_with_a_corrupt_adapter_stops_with_the_reason(
    tiny_model_dir: Path, corrupt: dict[str, Path]
) -> None:
    module = f"bad={corrupt['claims-2^40-bytes']}"
    stack = Stack(tiny_model_dir, core_flags=["--enable-lora", "--lora-modules", module])
    with pytest.raises(LaunchError) as stopped:
        stack.start()
    reason = str(stopped.value)
    assert reason.startswith(f"core exited with code 1: --lora-modules {module}: "), reason
    _assert_names_the_problem(reason, "claims-2^40-bytes")
