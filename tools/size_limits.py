"""Fail on a source file over 400 lines or a function over 80 lines (`make lint` runs it).

The habit the code keeps is short files (under 400 lines) and short functions (under ~50); these
are the hard ceilings, so a hub that grows is split along its seams before it passes review.
Ruff has no rule that measures this: `PLR0915` counts statements (a 90-line function of long
calls can have 40), and nothing in ruff counts a module's lines.

What is measured: every `*.py` under the given roots (the repository by default), except
  - tests (`tests/`): the rule is about source; a test module grows with the cases it lists,
  - generated code: protoc's `*_pb2.py`/`*_pb2_grpc.py` and every file that says `DO NOT EDIT`
    in its first lines (the records `make proto` writes); their size is the contract's,
  - hidden folders and virtual environments (`.venv`, `.tools`, `.git`, ...).
A function's length runs from its `def` line (decorators aside) to its last line, docstring
included; a nested function counts in its parent's length and is measured on its own too.
A Triton kernel (`@triton.jit`) is measured by its body: its parameter list is its launch ABI
(pointers, strides and compile-time constants, one per line: 30 of paged_attention_kernel's 93
lines), and splitting the body into jit helpers would pass a dozen of them to each and hide the
tile loop without shortening anything.

    python tools/size_limits.py [ROOT ...]      one line per breach, exit 1 if any
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
SKIPPED_FOLDERS = frozenset({"tests", "node_modules", "__pycache__", "build", "dist"})
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py")
GENERATED_MARKER = "DO NOT EDIT"
MARKER_LINES = 5


@dataclass(frozen=True)
class Breach:
    """One file or function over its limit, printed as `path:line: what is N lines (limit M)`."""

    path: Path
    line: int
    what: str
    lines: int
    limit: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what} is {self.lines} lines (limit {self.limit})"


def source_files(root: Path) -> Iterator[Path]:
    """The measured `*.py` files under `root`, in a stable order (see the module docstring)."""
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(
            name for name in subfolders if not name.startswith(".") and name not in SKIPPED_FOLDERS
        )
        for name in sorted(names):
            if name.endswith(".py") and not name.endswith(GENERATED_SUFFIXES):
                yield Path(folder) / name


def is_generated(text: str) -> bool:
    """Whether the file says it is generated (the marker protoc and `make proto` write)."""
    return any(GENERATED_MARKER in line for line in text.splitlines()[:MARKER_LINES])


def breaches_in(path: Path, text: str) -> Iterator[Breach]:
    """The file's own breach (too many lines), then each function's, in source order."""
    file_lines = len(text.splitlines())
    if file_lines > MAX_FILE_LINES:
        yield Breach(path, 1, "file", file_lines, MAX_FILE_LINES)
    functions = (
        node
        for node in ast.walk(ast.parse(text, filename=str(path)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    )
    for node in sorted(functions, key=lambda node: node.lineno):
        what, start = f"function {node.name}", node.lineno
        if any(is_triton_jit(decorator) for decorator in node.decorator_list):
            what, start = f"kernel {node.name}'s body", node.body[0].lineno
        length = (node.end_lineno or node.lineno) - start + 1
        if length > MAX_FUNCTION_LINES:
            yield Breach(path, node.lineno, what, length, MAX_FUNCTION_LINES)


def is_triton_jit(decorator: ast.expr) -> bool:
    """`@triton.jit` or `@triton.jit(...)`."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (
        isinstance(target, ast.Attribute)
        and target.attr == "jit"
        and isinstance(target.value, ast.Name)
        and target.value.id == "triton"
    )


def check(roots: list[Path]) -> list[Breach]:
    """Every breach under `roots`; generated files and tests aside."""
    found: list[Breach] = []
    for root in roots:
        for path in source_files(root):
            text = path.read_text(encoding="utf-8")
            if not is_generated(text):
                found.extend(breaches_in(path, text))
    return found


def main(argv: list[str]) -> int:
    breaches = check([Path(arg) for arg in argv] or [Path(".")])
    for breach in breaches:
        print(breach)
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
