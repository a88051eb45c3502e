"""The operator package's shape: no import cycle, a core in layers with no circle even through
imports inside functions or for type checking only, no file over MAX_LINES, and a pure core
that never imports kopf, kubernetes, ray or anything outside itself (the import-linter
contracts in pyproject.toml)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "operator"
PACKAGE = SOURCE / "tpufinetune"
CORE = PACKAGE / "core"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
MAX_LINES = 500
# The core's layers, bottom up: the models (pydantic types, no rules, no sizing), what reads
# them (the rules, their CEL twins, sizing, the memory plan), the API that composes them.
MODELS = ("apimodels", "specmodels")
READERS = ("validation", "celrules", "sizing", "memplan", "memplan_spec")
API = "api"


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, modules: set[str], everywhere: bool = False, name: str = "") -> set[str]:
    """Package modules imported at module level (imports under `if TYPE_CHECKING:` and
    inside functions do not count: they run later or never); with `everywhere`, every
    import in the file, those included."""
    name = name or module_name(path)
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in [tree] if everywhere else tree.body:
        if not everywhere and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        kinds = (ast.Module, ast.Import, ast.ImportFrom, ast.Try) if everywhere else (ast.Import, ast.ImportFrom, ast.Try)
        for child in ast.walk(node) if isinstance(node, kinds) else ():
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.split(".")
                base = base[: len(base) - child.level + 1] if child.level else []
                target = ".".join(base + ([child.module] if child.module else []))
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in child.names)
    return {m for m in found if m in modules and m != name}


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
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
    return cycles


def core_graph(root: Path = CORE) -> dict[str, set[str]]:
    """The core's modules and every core module each imports, wherever in the file (inside a
    function, under TYPE_CHECKING): a circle there is a knot of ideas, even one Python
    tolerates at run time."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    core = {p.stem: p for p in root.glob("*.py")}
    graph = {}
    for stem, path in core.items():
        imported = module_imports(path, set(paths) | {f"tpufinetune.core.{s}" for s in core}, everywhere=True,
                                  name=f"tpufinetune.core.{stem}")
        graph[stem] = {m.removeprefix("tpufinetune.core.") for m in imported
                       if m.startswith("tpufinetune.core.")} - {"__init__"}
    return {name: deps & set(graph) for name, deps in graph.items()}


def test_the_operator_package_has_no_import_cycle():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: module_imports(path, set(paths)) for name, path in paths.items()}
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
    assert "tpufinetune.core.sizing" in graph["tpufinetune.core.validation"]
    assert "tpufinetune.core.api" not in graph["tpufinetune.core.sizing"]


def test_the_core_has_no_circle_even_through_lazy_or_type_only_imports():
    graph = core_graph()
    cycles = import_cycles(graph)
    assert not cycles, "circles in core/ (counting imports in functions and under TYPE_CHECKING):\n" + "\n".join(cycles)
    assert "memplan" in graph["validation"] and "sizing" in graph["memplan_spec"]  # function-level ones are seen


def test_the_core_is_in_layers_models_then_readers_then_the_api():
    graph = core_graph()
    above_models = set(READERS) | {API}
    for model in MODELS:
        assert not graph[model] & above_models, f"{model} (a model) imports {graph[model] & above_models}"
    for reader in READERS:
        assert API not in graph[reader], f"{reader} imports the API above it"
    assert set(MODELS) & graph[API] and set(READERS) & graph[API]


def test_a_circle_through_a_lazy_import_is_caught(tmp_path):
    core = tmp_path / "core"
    core.mkdir()
    for path in CORE.glob("*.py"):
        (core / path.name).write_text(path.read_text())
    sizing = core / "sizing.py"
    sizing.write_text(sizing.read_text() + "\n\ndef _late():\n    from .api import parse_spec  # noqa\n")
    cycles = import_cycles(core_graph(core))
    assert any("sizing" in c and "api" in c for c in cycles), cycles


def test_no_operator_file_is_over_the_line_cap():
    long = {str(p.relative_to(SOURCE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split by idea): {long}"


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
