"""The structure the code promises (docs/architecture.md), checked: no import cycles, no oversized modules.

The layer contract itself is import-linter's (`lint-imports`, run by `make test`); these are what it does
not check: cycles between modules of the same layer, and module size.
"""

from __future__ import annotations

from pathlib import Path

import grimp

SOURCE = Path(__file__).resolve().parent.parent / "src" / "tensormorph"
MAX_LINES = 500


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == module:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_no_import_cycles():
    # a package's __init__ re-exporting its submodules is not a cycle of logic: leave package roots out
    graph = grimp.build_graph("tensormorph", exclude_type_checking_imports=True)
    packages = {m for m in graph.modules if (SOURCE.parent / m.replace(".", "/") / "__init__.py").is_file()}
    for package in packages:
        graph.remove_module(package)
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for module in ("p.a", "p.b", "p.c", "p.d"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    graph.add_import(importer="p.c", imported="p.d")
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_module_is_oversized():
    sizes = {path.relative_to(SOURCE).as_posix(): len(path.read_text().splitlines())
             for path in SOURCE.rglob("*") if path.suffix in (".py", ".js")}
    assert {name: lines for name, lines in sizes.items() if lines > MAX_LINES} == {}
