"""The architecture rules (docs/ARCHITECTURE.md) are checked by import-linter in `make lint`;
these tests run it on the tree, and on copies broken on purpose to show each rule can fail."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from tools.import_cycles import closing_chain, strongly_connected

ROOT = Path(__file__).resolve().parents[2]
LINT = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
PACKAGES = (
    "tools",
    "splitserve",
    "splitserve_client",
    "benchmarks",
    "frontend_svc",
    "core_svc",
    "worker_svc",
    "splitserve_runtime",
    "splitserve_contracts",
)
pytestmark = pytest.mark.skipif(LINT is None, reason="import-linter is not installed")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    assert LINT is not None
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}
    return subprocess.run(
        [LINT, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_tree_keeps_every_rule() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("tree")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", target)
    return target


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("core_svc/sched/scheduler.py", "import torch", "The engine core never imports torch"),
        (
            "core_svc/sched/scheduler.py",
            "from splitserve_contracts.core.v1 import core_service_pb2",
            "Protobuf stops at each service's edge",
        ),
        ("worker_svc/runner/model_runner.py", "import core_svc.request", "Imports point down"),
        ("splitserve_runtime/flags.py", "import splitserve.cli", "Imports point down"),
        ("splitserve_client/generate.py", "import torch", "The light client"),
        (
            "frontend_svc/engine/async_engine.py",
            "from smg_grpc_proto import vllm_engine_pb2",
            "The gateway contract (smg-grpc-proto) stops",
        ),
        (
            "worker_svc/layers/rotary.py",
            "import worker_svc.models.model_config",
            "Worker: models build on layers",
        ),
        (
            "worker_svc/runner/model_runner.py",
            "from worker_svc.models import llava",
            "The worker and its runners know models",
        ),
    ],
)
def test_each_rule_catches_a_violation(copy: Path, module: str, line: str, broken: str) -> None:
    path = copy / module
    original = path.read_text()
    path.write_text(
        original.replace(
            "from __future__ import annotations\n",
            f"from __future__ import annotations\n\n{line}\n",
            1,
        )
    )
    try:
        result = lint(copy)
    finally:
        path.write_text(original)
    assert result.returncode != 0
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout, result.stdout


def test_an_import_circle_is_found_and_named(copy: Path) -> None:
    """A circle the tree does not have (scheduler_state -> request_queue -> scheduler_state) is
    reported with its modules, whatever else the check reports."""
    path = copy / "core_svc" / "sched" / "request_queue.py"
    original = path.read_text()
    path.write_text(
        original.replace(
            "\nfrom core_svc.request import",
            "\nimport core_svc.sched.scheduler_state\nfrom core_svc.request import",
            1,
        )
    )
    try:
        result = lint(copy)
    finally:
        path.write_text(original)
    assert result.returncode != 0
    text = " ".join(result.stdout.split())
    assert "No import circles between modules (tools/import_cycles.py) BROKEN" in text
    assert "core_svc.sched.request_queue, core_svc.sched.scheduler_state" in text, result.stdout


def test_a_circle_through_a_package_init_is_a_circle() -> None:
    """import-linter's acyclic_siblings misses this one; the module check does not."""
    graph = grimp.ImportGraph()
    for importer, imported in [
        ("pkg", "pkg.a"),  # pkg/__init__.py re-exports from pkg.a
        ("pkg.a", "pkg.b"),
        ("pkg.b", "pkg"),  # pkg.b imports the package
        ("pkg.b", "pkg.c"),
    ]:
        graph.add_import(importer=importer, imported=imported)
    components = [c for c in strongly_connected(graph, graph.modules) if len(c) > 1]
    assert components == [["pkg", "pkg.a", "pkg.b"]]
    assert closing_chain(graph, components[0]) == ["pkg", "pkg.a", "pkg.b", "pkg"]
