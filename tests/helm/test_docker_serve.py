"""The one-container image (Dockerfile targets serve-cpu and serve-cuda): its entrypoint is
`splitserve serve`, so `docker run IMAGE MODEL [FLAGS]` serves the whole stack, reachable from
outside the container. No Docker engine here: the test runs the image's command line (ENTRYPOINT
+ CMD + MODEL + flags, with the image's environment) as the container would, and checks that the
HTTP API answers on an address other than 127.0.0.1 (every interface, as vLLM), that the image's
health check finds the frontend, and that SIGTERM drains and exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.stack import UP_ANY_METRICS_PORTS
from tests.fixtures.kernel_cache import seed_cpu_kernels
from tests.helm.test_docker import exec_form, load_healthcheck, parse_dockerfile

BIN = Path(sys.executable).parent
SERVE_STAGES = ("serve-cpu", "serve-cuda")
OTHER_LOOPBACK = "127.0.0.2"
"""On Linux every 127.x address reaches lo: a server bound to 127.0.0.1 refuses it, one bound
to every interface (0.0.0.0) answers, as it would answer on the container's own address."""


def image_command(stage_name: str) -> tuple[list[str], dict[str, str]]:
    """ENTRYPOINT + CMD of a serve stage, and the ENV it inherits from its base image."""
    dockerfile = parse_dockerfile()
    stage = dockerfile.stage(stage_name)
    base = dockerfile.stage(stage.base)
    command = exec_form(stage.last("ENTRYPOINT")) + exec_form(stage.last("CMD"))
    env_text = dockerfile.expand(" ".join(base.all("ENV")), base, env=True)
    env = dict(pair.split("=", 1) for pair in env_text.split() if "=" in pair)
    return command, env


@pytest.mark.parametrize("name", SERVE_STAGES)
def test_the_serve_images_run_splitserve_serve_on_every_interface(name: str) -> None:
    command, _ = image_command(name)
    assert command[:2] == ["splitserve", "serve"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    hc = load_healthcheck()
    argv = ["/opt/splitserve/bin/python", "/opt/splitserve/bin/splitserve", *command[1:], "m"]
    assert hc.role_of(argv) == "frontend"
    assert hc.port_of(argv, {}, "frontend") == 50051
    assert hc.port_of([*argv, "--port", "8080", "--grpc-port", "6000"], {}, "frontend") == 6000


@pytest.mark.slow
def test_docker_run_image_model_serves_the_whole_stack(
    tiny_model_dir: Path, tmp_path: Path, cpu_kernels_dir: Path | None
) -> None:
    command, image_env = image_command("serve-cpu")
    cache = tmp_path / "cache"
    seed_cpu_kernels(cache, cpu_kernels_dir)  # the image's cache volume, its kernels built
    env = {**os.environ, **image_env, "SPLITSERVE_CACHE_DIR": str(cache), "HOME": str(tmp_path)}
    env["HF_HOME"] = str(cache / "huggingface")
    env["PATH"] = f"{BIN}:{os.environ['PATH']}"
    # `docker run IMAGE MODEL FLAGS...`: the arguments follow the image's command. Free ports
    # here (other stacks share this machine); the image's defaults are vLLM's 8000 and 50051.
    argv = [str(BIN / command[0]), *command[1:], str(tiny_model_dir)]
    argv += ["--port", "0", "--grpc-port", "0", *UP_ANY_METRICS_PORTS]
    argv += ["--kv-cache-memory-bytes", str(16 << 20), "--max-model-len", "256"]
    serve = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        match = re.match(r"READY frontend=(\S+):(\d+) .* http=(\S+):(\d+)\n", line)
        assert match, line
        assert match[1] == match[3] == "0.0.0.0"
        base = f"http://{OTHER_LOOPBACK}:{match[4]}"
        with urllib.request.urlopen(f"{base}/health", timeout=30) as reply:
            assert reply.status == 200
        body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 4}).encode()
        request = urllib.request.Request(
            f"{base}/v1/completions", body, {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            completion = json.loads(reply.read())
        assert completion["usage"]["completion_tokens"] == 4
        hc = load_healthcheck()  # the image's HEALTHCHECK, on the frontend's gRPC port
        assert hc.check(f"{OTHER_LOOPBACK}:{match[2]}", hc.READINESS["frontend"], 10.0)
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=120) == 0
