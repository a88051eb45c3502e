"""Write the images' lock files from pip's own resolution (`pip install --dry-run --report`).

    python scripts/lock.py            # both images
    python scripts/lock.py trainer    # one

- requirements/operator.lock.txt: `.[operator]` for CPython 3.11 (Dockerfile.operator's
  python:3.11-slim base).
- requirements/trainer-py3XX.lock.txt: the trainer image's pins (the `train` extra) for each
  Python the TorchTPU base image may carry; Dockerfile.trainer picks the file that matches
  the base image's Python and fails when there is none. torch and its CUDA/Triton wheels
  are left out: torch stays the base image's TPU build.

Every entry is `name==version --hash=sha256:...` of the linux x86_64 wheel pip chose, so
`pip install --require-hashes --no-deps -r LOCK` installs exactly those files.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLATFORM = "manylinux_2_28_x86_64"
# Kept from the trainer's base image (its TPU build of torch), never reinstalled.
FROM_BASE_IMAGE = ("torch", "torch-tpu", "triton", "nvidia-")
# Pure-Python packages published as source only (installed from their hashed sdist).
SDIST_ONLY = ("rouge-score",)


def extra(name: str) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"][name]


def kept_pins(lock: Path) -> list[str]:
    """`name==version` of every package `lock` pins: constraints of its re-resolution, so a
    package added to an extra changes no other pin."""
    if not lock.exists():
        return []
    return [line.split()[0] for line in lock.read_text().splitlines() if "==" in line and not line.startswith("#")]


def resolve(requirements: list[str], python: str, keep: list[str] = ()) -> list[dict]:
    """pip's report of what it would install for `python` (e.g. '3.12') on linux x86_64,
    within the pins `keep` (constraints)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("".join(f"{pin}\n" for pin in keep))
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
             "--only-binary=:all:", f"--python-version={python}", f"--platform={PLATFORM}",
             "--platform=manylinux2014_x86_64", "--platform=linux_x86_64",
             f"--target={tmp}/target", "--report", str(report), "--constraint", str(constraints), *requirements],
            check=True)
        return json.loads(report.read_text())["install"]


def resolve_sdist(requirement: str) -> dict:
    """pip's report of a source-only package alone (it builds nothing but its metadata): its
    sdist's hash, and what it requires."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--no-deps",
             f"--target={tmp}/target", "--report", str(report), requirement],
            check=True)
        return json.loads(report.read_text())["install"][0]


def lock_text(installs: list[dict], header: str, skip: tuple[str, ...] = ()) -> str:
    lines = [f"# {line}".rstrip() for line in header.strip().splitlines()]
    for item in sorted(installs, key=lambda i: i["metadata"]["name"].lower()):
        name = item["metadata"]["name"].lower().replace("_", "-")
        if name == "tpufinetune" or name.startswith(skip):
            continue
        digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
        lines.append(f"{name}=={item['metadata']['version']} \\\n    --hash=sha256:{digest}")
    return "\n".join(lines) + "\n"


def lock_operator() -> None:
    installs = resolve([f"{ROOT}[operator]"], "3.11")
    header = """The operator image's Python set (Dockerfile.operator): `.[operator]` resolved for CPython
3.11 on linux/amd64, every package pinned with the hash of the file pip chose. Installed
with --require-hashes, so a rebuild gets exactly these files.
Written by `python scripts/lock.py operator`; rerun it after changing the `operator`
extra or the base pins in pyproject.toml."""
    (ROOT / "requirements" / "operator.lock.txt").write_text(lock_text(installs, header))


def lock_trainer() -> None:
    wanted = [r for r in extra("train") if not r.startswith(FROM_BASE_IMAGE)]
    # A pure-Python package PyPI has only as an sdist: pinned by its sdist's hash, what it
    # requires resolved with the rest as wheels (--only-binary refuses it).
    sdists = [resolve_sdist(r) for r in wanted if r.startswith(SDIST_ONLY)]
    needs = [d for s in sdists for d in s["metadata"].get("requires_dist", []) if "extra ==" not in d]
    for python in TRAINER_PYTHONS:
        path = ROOT / "requirements" / f"trainer-py{python.replace('.', '')}.lock.txt"
        keep = [pin for pin in kept_pins(path) if not pin.startswith(SDIST_ONLY)]
        installs = resolve([r for r in wanted if not r.startswith(SDIST_ONLY)] + needs, python, keep) + sdists
        header = f"""The trainer image's Python set (Dockerfile.trainer) when its base image runs CPython
{python}: the `train` extra resolved for linux/amd64, every package pinned with the hash of the
file pip chose, without torch (the base image's TPU build stays).
Written by `python scripts/lock.py trainer`; rerun it after changing the `train` extra."""
        path.write_text(lock_text(installs, header, FROM_BASE_IMAGE))


TRAINER_PYTHONS = ("3.11", "3.12", "3.13")
LOCKS = {"operator": lock_operator, "trainer": lock_trainer}

if __name__ == "__main__":
    for name in sys.argv[1:] or LOCKS:
        LOCKS[name]()
