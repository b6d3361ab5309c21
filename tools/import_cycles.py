"""An import-linter contract type: no import circle between any two modules.

`make lint` checks it with the other contracts (`lint-imports`; `[tool.importlinter]` in
pyproject.toml names this class under `contract_types`). It reads grimp's import graph (the
graph library import-linter is built on): every module of `packages`, a package's `__init__`
included, and every import, also those inside functions and `if TYPE_CHECKING:` blocks. Each
strongly connected component of more than one module is a circle; the contract reports each with
its modules and one chain of imports that closes it. (import-linter's own `acyclic_siblings` contract compares
sibling packages, so it misses a circle through a package's `__init__` or across root packages.)
"""

from __future__ import annotations

from collections.abc import Iterable

import grimp
from importlinter import Contract, ContractCheck, fields, output


class AcyclicModulesContract(Contract):
    """Fails when modules of `packages` import each other in a circle."""

    type_name = "acyclic_modules"
    packages = fields.ListField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        roots = set(self.packages)  # type: ignore[call-overload]
        modules = sorted(m for m in graph.modules if m.split(".")[0] in roots)
        circles = [
            (component, closing_chain(graph, component))
            for component in strongly_connected(graph, modules)
            if len(component) > 1
        ]
        return ContractCheck(kept=not circles, warnings=[], metadata={"circles": circles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for component, chain in check.metadata["circles"]:
            output.print_error(f"Import circle among {len(component)} modules:")
            output.print_error(", ".join(component), bold=False)
            output.print_error(f"for one: {' -> '.join(chain)}", bold=False)
            output.new_line()


def strongly_connected(graph: grimp.ImportGraph, modules: Iterable[str]) -> list[list[str]]:
    """Tarjan's algorithm over the imports among `modules`, without recursion."""
    nodes = set(modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start) & nodes)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, imported = work[-1]
            step = next(imported, None)
            if step is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    components.append(_pop_component(stack, on_stack, module))
            elif step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                on_stack.add(step)
                work.append(
                    (step, iter(sorted(graph.find_modules_directly_imported_by(step) & nodes)))
                )
            elif step in on_stack:
                low[module] = min(low[module], index[step])
    return components


def _pop_component(stack: list[str], on_stack: set[str], root: str) -> list[str]:
    component = []
    while True:
        module = stack.pop()
        on_stack.discard(module)
        component.append(module)
        if module == root:
            return sorted(component)


def closing_chain(graph: grimp.ImportGraph, component: list[str]) -> list[str]:
    """One circle within the component: its first module, what it imports there, and the
    shortest chain back."""
    first = component[0]
    members = set(component)
    step = min(graph.find_modules_directly_imported_by(first) & members)
    back = graph.find_shortest_chain(importer=step, imported=first) or (step, first)
    return [first, *back]
