"""docker/Dockerfile without a Docker engine: every path it copies exists and survives
.dockerignore, every command it runs exists, dependencies and bases are pinned, the images run as
a non-root user, and the gRPC health check works against a real health service."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from splitserve.cli import COMMANDS
from tests.helm.chart_render import CHART_DIR, REPO_ROOT, Manifests
from tools.lock import pins as lock_pins

DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
REQUIREMENTS = REPO_ROOT / "locks" / "image.txt"
FINAL_STAGES = ("cpu", "cuda")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"stage {self.name} has no {keyword}"
        return found[-1]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def expand(self, text: str, stage: Stage | None = None, *, env: bool = False) -> str:
        """Substitute ARGs like Docker does: FROM lines see the ARGs before the first FROM; inside
        a stage only the ARGs that stage (re)declares. `env`: leave other $VARs (e.g. the base
        image's PATH in an ENV line) alone instead of failing."""
        if stage is None:
            values = dict(self.global_args)
        else:
            values = {}
            for arg in stage.all("ARG"):
                name, _, default = arg.partition("=")
                values[name] = default or self.global_args.get(name, "")

        def sub(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            if env and name not in values:
                return match.group(0)
            assert name in values, f"${name} is not an ARG declared in this stage"
            return values[name]

        return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, text)


def instructions(text: str) -> Iterator[tuple[str, str]]:
    """(KEYWORD, rest) per instruction: comments dropped, continuation lines joined."""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        yield keyword.upper(), rest.strip()


def parse_dockerfile(path: Path = DOCKERFILE) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in instructions(path.read_text()):
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else ""
            stages.append(Stage(name, parts[0]))
        elif not stages:
            assert keyword == "ARG", f"only ARG may precede the first FROM, got {keyword}"
            name, _, default = rest.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append((keyword, rest))
    return Dockerfile(global_args, stages)


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile()


def copy_parts(rest: str) -> tuple[dict[str, str], list[str], str]:
    """COPY [--flag=value ...] SRC... DEST -> (flags, sources, dest)."""
    words = shlex.split(rest)
    flags = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    return flags, words[:-1], words[-1]


def exec_form(rest: str) -> list[str]:
    parsed = json.loads(rest)
    assert isinstance(parsed, list) and all(isinstance(p, str) for p in parsed), rest
    return parsed


def dockerignore_excludes(path: str) -> bool:
    """Whether .dockerignore keeps `path` (relative to the context root) out of the context."""
    patterns = [
        p.strip()
        for p in DOCKERIGNORE.read_text().splitlines()
        if p.strip() and not p.strip().startswith("#")
    ]

    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                out += ".*"
                i += 2
            elif pattern[i] == "*":
                out += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                out += "[^/]"
                i += 1
            else:
                out += re.escape(pattern[i])
                i += 1
        return re.compile(out + "$")

    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        rx = regex(pattern.lstrip("!").strip("/"))
        # Like Docker: a pattern that matches a parent folder applies to everything inside it.
        if any(rx.match(c) for c in candidates):
            excluded = not negate
    return excluded


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


# -- structure --------------------------------------------------------------------------------


def test_one_dockerfile_builds_a_cpu_and_a_cuda_image(dockerfile: Dockerfile) -> None:
    names = [s.name for s in dockerfile.stages]
    assert names[-2:] == list(FINAL_STAGES) or set(FINAL_STAGES) <= set(names)
    cuda_base = dockerfile.expand(dockerfile.stage("cuda-python").base)
    assert cuda_base.startswith("nvidia/cuda:") and "runtime" in cuda_base
    cpu_base = dockerfile.expand(dockerfile.stage("cpu-python").base)
    assert cpu_base.startswith("python:")


def test_base_images_are_pinned(dockerfile: Dockerfile) -> None:
    stage_names = {s.name for s in dockerfile.stages}
    for stage in dockerfile.stages:
        base = dockerfile.expand(stage.base)
        if base in stage_names or base == "scratch":
            continue
        image, _, tag = base.rpartition(":")
        assert image and tag and tag != "latest", f"{base} is not pinned to a version"
        assert re.search(r"\d+\.\d+", tag), f"{base}: tag {tag!r} names no version"


def test_cpu_and_cuda_run_the_same_python(dockerfile: Dockerfile) -> None:
    version = dockerfile.global_args["PYTHON_VERSION"]
    assert dockerfile.expand("${CPU_BASE_IMAGE}").startswith(f"python:{version}-")
    requires = pyproject()["project"]["requires-python"]
    assert Requirement(f"python{requires}").specifier.contains(version)


def test_every_copy_source_exists_and_is_in_the_build_context(dockerfile: Dockerfile) -> None:
    stage_names = [s.name for s in dockerfile.stages]
    for index, stage in enumerate(dockerfile.stages):
        for rest in stage.all("COPY"):
            flags, sources, _ = copy_parts(dockerfile.expand(rest, stage))
            if "from" in flags:
                # Another stage (defined earlier) or an image reference.
                assert flags["from"] in stage_names[:index] or ":" in flags["from"], rest
                continue
            for source in sources:
                assert (REPO_ROOT / source).exists(), f"COPY {source}: no such path"
                assert not dockerignore_excludes(source), f"COPY {source}: in .dockerignore"


def test_dockerignore_keeps_junk_out() -> None:
    for path in (
        ".venv",
        ".git",
        "tests",
        "helm",
        "splitserve/__pycache__",
        "docs",
        "splitserve.egg-info",
    ):
        assert dockerignore_excludes(path), path
    assert not dockerignore_excludes("splitserve/cli.py")


def test_the_source_stage_holds_every_package(dockerfile: Dockerfile) -> None:
    copied = {copy_parts(rest)[1][0] for rest in dockerfile.stage("source").all("COPY")}
    include = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}
    assert packages | {"pyproject.toml"} <= copied


# -- users, commands, health ------------------------------------------------------------------


@pytest.mark.parametrize("name", FINAL_STAGES)
def test_final_images_run_as_the_charts_non_root_user(dockerfile: Dockerfile, name: str) -> None:
    stage = dockerfile.stage(name)
    user = dockerfile.expand(stage.last("USER"), stage)
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {user} must be a numeric non-root uid"
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert (
        int(uid)
        == values["podSecurityContext"]["runAsUser"]
        == values["securityContext"]["runAsUser"]
    )
    assert int(gid) == values["podSecurityContext"]["runAsGroup"]
    # The cache folder the chart mounts an emptyDir over also exists (writable) in the image.
    env = dockerfile.expand(" ".join(stage.all("ENV")), stage, env=True)
    assert f"SPLITSERVE_CACHE_DIR={values['cache']['mountPath']}" in env


@pytest.mark.parametrize("name", FINAL_STAGES)
def test_entrypoint_and_cmd_exist(dockerfile: Dockerfile, name: str) -> None:
    stage = dockerfile.stage(name)
    entrypoint = exec_form(stage.last("ENTRYPOINT"))
    cmd = exec_form(stage.last("CMD"))
    scripts = pyproject()["project"]["scripts"]
    assert entrypoint == ["splitserve"] and "splitserve" in scripts
    assert scripts["splitserve"] == "splitserve.cli:main"
    assert cmd[0] in COMMANDS
    assert importlib.util.find_spec(f"{cmd[0]}_svc.__main__") is not None


@pytest.mark.parametrize("name", FINAL_STAGES)
def test_healthcheck_runs_a_script_the_image_contains(dockerfile: Dockerfile, name: str) -> None:
    stage = dockerfile.stage(name)
    healthcheck = stage.last("HEALTHCHECK")
    options, _, command = healthcheck.partition(" CMD ")
    assert "--start-period=" in options and "--interval=" in options
    argv = exec_form(command.strip())
    copied = {}
    for rest in stage.all("COPY"):
        flags, sources, dest = copy_parts(rest)
        if "from" not in flags:
            copied[dest] = (sources[0], flags)
    target = argv[0] if argv[0].startswith("/") else f"/usr/local/bin/{argv[0]}"
    assert target in copied, f"HEALTHCHECK runs {argv[0]}, which no COPY puts in the image"
    source, flags = copied[target]
    assert flags.get("chmod") == "0755"
    assert (REPO_ROOT / source).read_text().startswith("#!/usr/bin/env python3\n")


# Programs of both base images (Debian / Ubuntu coreutils) the chart's hooks may run.
BASE_IMAGE_TOOLS = {"sleep"}


def test_chart_commands_exist_in_the_image(default_manifests: Manifests) -> None:
    for _, container in default_manifests.containers():
        command = container["command"]
        assert command[0] == "splitserve", command
        assert command[1] in COMMANDS
        assert importlib.util.find_spec(f"{command[1]}_svc.__main__") is not None
        pre_stop = container.get("lifecycle", {}).get("preStop", {})
        if pre_stop:  # the drain's sleep (docs/deploy.md#drain)
            assert pre_stop["exec"]["command"][0] in BASE_IMAGE_TOOLS, pre_stop


# -- pinned dependencies ----------------------------------------------------------------------


def pinned_requirements() -> dict[str, str]:
    return lock_pins(REQUIREMENTS)


def test_requirements_pin_every_runtime_dependency() -> None:
    pins = pinned_requirements()
    for dep in pyproject()["project"]["dependencies"]:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        if name == "torch":
            assert name not in pins  # installed from the variant's PyTorch index
            continue
        assert name in pins, f"{name} is not pinned in locks/image.txt"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} violates {dep}"


def test_pip_installs_only_pinned_packages(dockerfile: Dockerfile) -> None:
    torch_pin = next(
        Requirement(d) for d in pyproject()["project"]["dependencies"] if d.startswith("torch")
    )
    assert str(torch_pin.specifier) == f"=={dockerfile.global_args['TORCH_VERSION']}"
    seen_requirement_file = False
    for stage in dockerfile.stages:
        for run in stage.all("RUN"):
            for command in run.split("&&"):
                words = shlex.split(dockerfile.expand(command, stage))
                if "pip" not in " ".join(words[:1]) or "install" not in words:
                    continue
                args = words[words.index("install") + 1 :]
                i = 0
                while i < len(args):
                    arg = args[i]
                    if arg in ("--requirement", "-r"):
                        assert args[i + 1] == "/tmp/requirements.txt"
                        seen_requirement_file = True
                        i += 2
                    elif arg in ("--index-url", "--constraint", "-c"):
                        i += 2
                    elif arg.startswith("-"):
                        i += 1
                    else:
                        assert arg.startswith("/") or "==" in arg, f"unpinned install: {arg}"
                        i += 1
    assert seen_requirement_file
    assert {"cpu-venv", "cuda-venv"} <= {s.name for s in dockerfile.stages}
    for venv_stage in ("cpu-venv", "cuda-venv"):
        copies = [copy_parts(r) for r in dockerfile.stage(venv_stage).all("COPY")]
        assert any(src == ["locks/image.txt"] for _, src, _ in copies)


def test_image_lock_is_the_runtime_lock_without_torch() -> None:
    """locks/image.txt pins what the services need at run time, at the runtime lock's versions:
    nothing from the dev extra, torch left to the variant's index, every pin hashed."""
    image, runtime = pinned_requirements(), lock_pins(REPO_ROOT / "locks" / "runtime.txt")
    assert "torch" not in image and "torch" in runtime
    assert image.items() <= runtime.items(), set(image.items()) - set(runtime.items())
    assert set(runtime) - set(image) <= {"torch", "pip"}
    dev = {
        canonicalize_name(Requirement(d).name)
        for d in pyproject()["project"]["optional-dependencies"]["dev"]
    }
    runtime_roots = {
        canonicalize_name(Requirement(d).name) for d in pyproject()["project"]["dependencies"]
    }
    assert not set(image) & (dev - runtime_roots - {"pyyaml"})  # pyyaml: also a runtime dep


@pytest.mark.slow
def test_source_stage_builds_a_wheel_with_the_entrypoints(
    dockerfile: Dockerfile, tmp_path: Path
) -> None:
    """What the venv stages do with /src, from exactly what the source stage copies."""
    src = tmp_path / "src"
    for rest in dockerfile.stage("source").all("COPY"):
        _, sources, dest = copy_parts(rest)
        target = src / Path(dest).relative_to("/src")
        origin = REPO_ROOT / sources[0]
        if origin.is_dir():
            import shutil

            shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(origin.read_bytes())
    out = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(src),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    wheel = next(out.glob("splitserve-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "splitserve = splitserve.cli:main" in entry_points
    for module in (
        "frontend_svc/__main__.py",
        "core_svc/__main__.py",
        "worker_svc/__main__.py",
        "splitserve_contracts/frontend/v1/generation_service_pb2.py",
        "splitserve_client/generate.py",
        "worker_svc/kernels/cpu_ops.cpp",
        "worker_svc/kernels/sampling_ops.cpp",
        "worker_svc/kernels/cpu_common.h",
    ):
        assert module in names, module


# -- the health check script ------------------------------------------------------------------


def load_healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "splitserve_healthcheck", REPO_ROOT / "docker" / "healthcheck.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_reads_role_and_port_from_the_command_line() -> None:
    hc = load_healthcheck()
    assert (
        hc.role_of(
            [
                "/opt/splitserve/bin/python",
                "/opt/splitserve/bin/splitserve",
                "core",
                "--port",
                "6000",
            ]
        )
        == "core"
    )
    assert hc.role_of(["python", "-m", "worker_svc"]) == "worker"
    assert hc.port_of(["splitserve", "core", "--port", "6000"], {}, "core") == 6000
    assert hc.port_of(["splitserve", "core", "--port=6001"], {}, "core") == 6001
    assert hc.port_of(["splitserve", "worker"], {"SPLITSERVE_PORT": "7000"}, "worker") == 7000
    assert hc.port_of(["splitserve", "worker"], {}, "worker") == 50071


def test_healthcheck_against_a_real_health_service() -> None:
    hc = load_healthcheck()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        addr = f"127.0.0.1:{port}"
        core = hc.READINESS["core"]
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        servicer.set(core, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert hc.main(["--addr", addr, "--liveness"], {}) == 0
        assert hc.main(["--addr", addr, "--service", core], {}) == 1
        servicer.set(core, health_pb2.HealthCheckResponse.SERVING)
        assert hc.main(["--addr", addr, "--service", core], {}) == 0
        assert hc.main(["--addr", addr, "--service", "no.such.Service"], {}) == 1
    finally:
        server.stop(None)
    assert hc.main(["--addr", addr, "--liveness", "--timeout", "0.5"], {}) == 1
