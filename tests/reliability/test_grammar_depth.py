"""Grammars deep enough to overflow a thread's stack (issue 37 item 5): a Lark grammar of 4,000
chained rules (66 KB) made llguidance's compiler recurse past the frontend's 8 MiB thread, and
the frontend died of SIGSEGV (exit -11) with every stream on it. Grammars now compile on
threads of a 512 MiB stack (splitserve_runtime/grammar_stack.py), in the frontend's check and
the core's compile alike, so what llguidance compiles is served and what it refuses is a 400.

- every shape, depth and width, in a process of its own, through the frontend's check and the
  core's compile: each one compiles or is refused, and the process lives through them all;
- the same over the OpenAI HTTP API and the VllmEngine gRPC port, with a stream beside them
  that finishes; and a property-based fuzz of depth and width over HTTP after which every
  process is alive.

No timing assertions: what these check is that nothing dies."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from splitserve_contracts.structured_outputs import MAX_SPEC_CHARS
from tests.e2e.stack import Stack
from tests.reliability.grammar_shapes import (
    DEEPEST,
    MAX_LARK_GROUPS,
    Shape,
    largest,
    nested_json,
    nested_regex,
    nested_schema,
    ref_chain,
    rule_chain,
    tagged,
)
from tests.reliability.http_probes import (
    assert_http_serving_and_idle,
    assert_openai_error,
    http_call,
    post_json,
)
from tests.reliability.probes import assert_serving_and_idle, rich_status

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
COMPLETIONS = "/v1/completions"
STREAM_TOKENS = 400
"""The stream beside the deep grammars: long enough to be in flight while they are sent."""
ISSUE_GRAMMAR = (
    "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(3_999)) + 'r3999: "a"\n'
)
"""The issue's grammar: 4,000 chained rules, 65,787 characters (overflowed at ~2,650 rules)."""
SERVED: dict[str, Shape] = {
    "the issue's 4,000 chained rules": ("grammar", ISSUE_GRAMMAR),
    "the deepest grammar of 256 KiB": largest(DEEPEST["rules in 28 groups each"]),
}
REFUSED: dict[str, tuple[Shape, str]] = {
    "29 nested groups": (rule_chain(2, groups=MAX_LARK_GROUPS + 1), "too deeply nested"),
    "5,000 nested arrays": (nested_json(5_000), "nests too deeply"),
    "5,000 nested objects": (nested_json(5_000, "properties"), "nests too deeply"),
    "5,000 nested arrays in a structural tag": (tagged(nested_schema(5_000)), "nests too deeply"),
    "200 nested objects": (nested_json(200, "properties"), "recursion limit"),
    "5,000 nested regex groups": (nested_regex(5_000), "invalid regex"),
    "chained rules past the length limit": (rule_chain(40_000), f"at most {MAX_SPEC_CHARS}"),
}
"""What llguidance (or the length limit) refuses -> a fragment of the reason."""


def _alive(stack: Stack) -> None:
    for child in stack.children:
        assert child.process.poll() is None, f"the {child.name} died"


def test_every_depth_and_width_compiles_or_is_refused_in_the_check_and_the_core(
    tiny_model_dir: Path,
) -> None:
    """The library-level fuzz: tests/reliability/grammar_depth_probe.py runs each case through
    check_grammar and the core's StructuredOutputManager in one process and prints a line for
    it; a case deeper than the thread's stack would kill the process there (on main it died at
    1,000 chained rules of 5 nested groups each)."""
    tokenizer = tiny_model_dir / "tokenizer.json"
    probe = [sys.executable, "-m", "tests.reliability.grammar_depth_probe", str(tokenizer)]
    done = subprocess.run(probe, cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, f"died after {lines[-1:]}: {done.stderr[-2000:]}"
    results = {label: (checked, compiled) for label, checked, compiled in map(_split, lines)}
    assert len(results) == len(lines) >= 60
    for label, outcomes in results.items():
        for outcome in outcomes:
            assert outcome == "ok" or outcome.startswith("refused: structured_outputs."), label
    for label in DEEPEST:
        if label != "$refs through items":  # llguidance: "schema too large"
            assert results[f"largest: {label}"] == ("ok", "ok"), label
    assert "nests too deeply" in results["nested json d=5000"][0]


def _split(line: str) -> tuple[str, str, str]:
    label, checked, compiled = line.split("\t")
    return label, checked, compiled


class Stream:
    """A long completion streamed on its own thread; `finish_reason` once it ended."""

    def __init__(self, thunk: Any) -> None:
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(thunk,), daemon=True)
        self.thread.start()

    def _run(self, thunk: Any) -> None:
        try:
            self.finish_reason = thunk()
        except BaseException as err:  # noqa: BLE001 (asserted by the test)
            self.error = err

    def wait(self) -> str | None:
        self.thread.join(300)
        assert self.error is None, repr(self.error)
        return self.finish_reason


def _http_stream(base: str) -> str | None:
    body = {"prompt": "tell", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
    status, text, _ = http_call(base, "POST", COMPLETIONS, json.dumps(body).encode())
    assert status == 200, text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return chunks[-1]["choices"][0]["finish_reason"]


def _constrained(field: str, text: str) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, "structured_outputs": {field: text}}


def test_deep_grammars_over_http_are_served_or_refused_and_a_stream_beside_them_finishes(
    shared_stack: Stack,
) -> None:
    stream = Stream(lambda: _http_stream(shared_stack.http))
    for label, (field, text) in SERVED.items():
        status, reply = post_json(shared_stack.http, COMPLETIONS, _constrained(field, text))
        assert status == 200, (label, str(reply)[:300])
        _alive(shared_stack)
    for label, ((field, text), fragment) in REFUSED.items():
        status, reply = post_json(shared_stack.http, COMPLETIONS, _constrained(field, text))
        assert status == 400, (label, str(reply)[:300])
        error = assert_openai_error(reply, 400)
        assert fragment in error["message"] and error["param"] == f"structured_outputs.{field}"
        _alive(shared_stack)
    for depth in (900, 990, 5_000):  # the schema as an object in the body, not as text
        schema = nested_schema(depth)
        form = f'{{"type": "json_schema", "json_schema": {{"name": "deep", "schema": {schema}}}}}'
        raw = f'{{"prompt": "hi", "response_format": {form}}}'
        status, reply, _ = http_call(shared_stack.http, "POST", COMPLETIONS, raw.encode())
        assert status == 400, (depth, str(reply)[:300])
        assert_openai_error(reply, 400)
        _alive(shared_stack)
    assert stream.wait() == "length"
    assert_http_serving_and_idle(shared_stack)


ENGINE_FIELDS = {"grammar": "grammar", "json": "json_schema", "regex": "regex"}
"""A structured-outputs field -> its name in the VllmEngine SamplingParams."""


def _engine_request(request_id: str, max_tokens: int, **constraint: str) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **constraint)
    return pb.GenerateRequest(
        request_id=request_id, tokenized=pb.TokenizedInput(input_ids=[40, 41, 42]),
        sampling_params=params, stream=True,
    )  # fmt: skip


def test_deep_grammars_on_the_engine_port_are_served_or_refused_and_a_stream_finishes(
    shared_stack: Stack,
) -> None:
    with grpc.insecure_channel(shared_stack.frontend) as channel:
        stub = pb_grpc.VllmEngineStub(channel)

        def long_stream() -> str:
            request = _engine_request("beside", STREAM_TOKENS)
            replies = list(stub.Generate(request, timeout=300))
            return replies[-1].complete.finish_reason

        stream = Stream(long_stream)
        for i, (label, (field, text)) in enumerate(SERVED.items()):
            request = _engine_request(f"served-{i}", 2, **{ENGINE_FIELDS[field]: text})
            replies = list(stub.Generate(request, timeout=120))
            assert replies[-1].complete.finish_reason, label
            _alive(shared_stack)
        for i, (label, ((field, text), fragment)) in enumerate(REFUSED.items()):
            if field not in ENGINE_FIELDS:
                continue
            request = _engine_request(f"refused-{i}", 2, **{ENGINE_FIELDS[field]: text})
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=120))
            status = rich_status(info.value)
            assert status.code == grpc.StatusCode.INVALID_ARGUMENT, (label, status.message)
            assert fragment in status.message, (label, status.message)
            assert status.fields == [f"sampling_params.{ENGINE_FIELDS[field]}"], label
            _alive(shared_stack)
        assert stream.wait() == "length"
    assert_serving_and_idle(shared_stack)


FUZZ = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.generate],  # a failing case names its shape; shrinking would take minutes
)
DEPTH = st.integers(0, 14).map(lambda bits: 2**bits) | st.integers(1, 6_000)
"""Most shapes fit MAX_SPEC_CHARS at these depths, the deeper and wider ones do not."""
SHAPES = st.one_of(
    st.builds(rule_chain, DEPTH, st.integers(1, 8), st.integers(0, 30), st.booleans()),
    st.builds(ref_chain, DEPTH, st.sampled_from(["properties", "items", "anyOf"]), st.integers(1, 8)),
    st.builds(nested_json, DEPTH, st.sampled_from(["items", "properties"])),
    st.builds(nested_regex, DEPTH, st.integers(1, 16)),
    st.builds(lambda depth: tagged(ref_chain(depth)[1]), DEPTH),
)  # fmt: skip


@FUZZ
@given(shape=SHAPES)
def test_fuzzed_depths_and_widths_leave_every_process_alive(
    shared_stack: Stack, shape: Shape
) -> None:
    """Each case is served (200), refused (400: by the frontend's check, or by the engine when
    llguidance compiled it but its matcher stopped mid-way, e.g. past 2,000 Earley items in a
    row, which long right-recursive choices reach), or fails while it generates (503), and no
    process dies."""
    field, text = shape
    status, reply = post_json(shared_stack.http, COMPLETIONS, _constrained(field, text))
    assert status in (200, 400, 503), (field, len(text), text[:200], str(reply)[:300])
    if status == 400:  # the frontend's check names the field as `param`; the engine's
        error = assert_openai_error(reply, 400)  # refusal (a matcher that failed) in its text
        path = f"structured_outputs.{field}"
        assert error["param"] == path or error["message"].startswith(
            f"refused by the engine: {path}: "
        ), error
    elif status == 503:
        assert_openai_error(reply, 503)
    _alive(shared_stack)
