"""The operator package's modules import each other without a cycle (imports under
`if TYPE_CHECKING:` and inside functions do not count: they run later or never)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "tpufinetune"


def module_imports(path: Path) -> set[str]:
    """Sibling modules imported at module level."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for child in ast.walk(node) if isinstance(node, (ast.Import, ast.ImportFrom, ast.Try)) else ():
            if isinstance(child, ast.ImportFrom):
                if child.level == 1 and child.module:
                    found.add(child.module.split(".")[0])
                elif child.level == 1:
                    found.update(alias.name for alias in child.names)
                elif (child.module or "").startswith("tpufinetune."):
                    found.add(child.module.split(".")[1])
                elif child.module == "tpufinetune":
                    found.update(alias.name for alias in child.names)
    return found


def test_the_operator_package_has_no_import_cycle():
    graph = {p.stem: module_imports(p) for p in PACKAGE.glob("*.py")}
    graph = {name: {d for d in deps if d in graph and d != name} for name, deps in graph.items()}
    visiting, done, cycles = set(), set(), []

    def visit(name: str, path: list[str]) -> None:
        if name in done:
            return
        if name in visiting:
            cycles.append(" -> ".join(path[path.index(name):] + [name]))
            return
        visiting.add(name)
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        visiting.discard(name)
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
    assert "sizing" in graph["validation"] and "api" not in graph["sizing"]
