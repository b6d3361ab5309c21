"""Place protoc's Python output in the `splitserve_contracts` package.

protoc names Python modules after the .proto paths (`splitserve/core/v1/...`), which would put
the generated code inside `splitserve`, the user-facing package at the top of the import graph.
This copies the generated files of every contract area to `<out>/splitserve_contracts/<area>/v1/`
and rewrites their imports (and the module names they register) to match. The proto packages, and
with them every wire name such as `/splitserve.frontend.v1.GenerationService/Generate`, do not
change: only where the Python code lives does.

Usage: python protos/python_package.py GENERATED_DIR OUT_DIR
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PACKAGE = "splitserve_contracts"
AREAS = ("common", "core", "frontend", "kv", "worker")
_AREA = "|".join(AREAS)
# Import statements in .py and .pyi files, and the module name protobuf registers classes under.
_IMPORT = re.compile(rf"^(from|import) splitserve\.({_AREA})\.v1\b", re.MULTILINE)
_MODULE_NAME = re.compile(
    rf"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')splitserve\.({_AREA})\.v1\."
)
# Type stubs refer to other modules by their full dotted path (they hold no serialized bytes).
_STUB_REFERENCE = re.compile(rf"\bsplitserve\.({_AREA})\.v1\.")


def relocate(text: str, is_stub: bool) -> str:
    text = _IMPORT.sub(rf"\1 {PACKAGE}.\2.v1", text)
    if is_stub:
        return _STUB_REFERENCE.sub(rf"{PACKAGE}.\1.v1.", text)
    return _MODULE_NAME.sub(rf"\1{PACKAGE}.\2.v1.", text)


def main(generated: Path, out: Path) -> None:
    for area in AREAS:
        target = out / PACKAGE / area / "v1"
        target.mkdir(parents=True, exist_ok=True)
        for package in (out / PACKAGE, target.parent, target):
            (package / "__init__.py").touch()
        for source in sorted((generated / "splitserve" / area / "v1").glob("*_pb2*.py*")):
            text = relocate(source.read_text(), is_stub=source.suffix == ".pyi")
            (target / source.name).write_text(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
