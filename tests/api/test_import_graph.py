"""The operator package's shape: no import cycle, and a pure core that never imports kopf,
kubernetes, ray or anything outside itself (the import-linter contracts in pyproject.toml)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "operator"
PACKAGE = SOURCE / "tpufinetune"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """Package modules imported at module level (imports under `if TYPE_CHECKING:` and
    inside functions do not count: they run later or never)."""
    name = module_name(path)
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for child in ast.walk(node) if isinstance(node, (ast.Import, ast.ImportFrom, ast.Try)) else ():
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.split(".")
                base = base[: len(base) - child.level + 1] if child.level else []
                target = ".".join(base + ([child.module] if child.module else []))
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in child.names)
    return {m for m in found if m in modules and m != name}


def test_the_operator_package_has_no_import_cycle():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: module_imports(path, set(paths)) for name, path in paths.items()}
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
    assert "tpufinetune.core.sizing" in graph["tpufinetune.core.validation"]
    assert "tpufinetune.core.api" not in graph["tpufinetune.core.sizing"]


def lint_imports(source: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=source, env={"PYTHONPATH": str(source), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120)


def test_the_core_keeps_its_import_contracts():
    result = lint_imports(SOURCE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout


def test_the_contract_breaks_when_the_core_imports_kubernetes(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "tpufinetune", ignore=shutil.ignore_patterns("__pycache__"))
    sizing = tmp_path / "tpufinetune" / "core" / "sizing.py"
    sizing.write_text(sizing.read_text() + "\nimport kubernetes  # noqa\nfrom ..adapters import kube  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "tpufinetune.core.sizing -> kubernetes" in result.stdout
    assert "tpufinetune.core.sizing -> tpufinetune.adapters.kube" in result.stdout
