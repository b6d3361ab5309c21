"""The version stamps in the committed generated code: what `make proto-check` keeps exact.

`make proto-check` regenerates with the locked grpcio-tools and compares every byte, stamps
included. The stamps are not noise: a `*_pb2_grpc.py` raises at import under a grpcio older than
its GRPC_GENERATED_VERSION, and a `*_pb2.py` under a protobuf older than its gencode version. So
the lock's code generator must stamp no newer a version than pyproject.toml lets a user install."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from tools.lock import BY_NAME, pins

ROOT = Path(__file__).resolve().parents[3]
CONTRACTS = ROOT / "splitserve_contracts"


def floor(package: str) -> Version:
    """The lowest version pyproject.toml's runtime requirement on `package` allows."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    req = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == package)
    (low,) = [s for s in req.specifier if s.operator == ">="]
    return Version(low.version)


def test_grpc_stubs_are_stamped_by_the_locked_generator_at_the_runtime_floor() -> None:
    locked = pins(BY_NAME["dev"].path)["grpcio-tools"]
    stubs = sorted(CONTRACTS.rglob("*_pb2_grpc.py"))
    assert stubs
    for stub in stubs:
        stamp = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", stub.read_text(), re.M)
        assert stamp, stub
        assert stamp.group(1) == locked, f"{stub.name}: stamped {stamp.group(1)}; run make proto"
        assert Version(stamp.group(1)) <= floor("grpcio"), (
            f"{stub.name} needs grpcio>={stamp.group(1)}, pyproject.toml allows {floor('grpcio')}"
        )


def test_messages_need_no_newer_protobuf_than_pyproject_allows() -> None:
    call = re.compile(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),")
    modules = sorted(CONTRACTS.rglob("*_pb2.py"))
    assert modules
    for module in modules:
        found = call.search(module.read_text())
        assert found, module
        gencode = Version(".".join(found.groups()))
        assert gencode <= floor("protobuf"), f"{module.name} needs protobuf>={gencode}"
