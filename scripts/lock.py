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
# Pure-Python packages published as source only (installed from their hashed sdist): the
# extra's own (rouge-score) and lm-eval's dependencies (sqlitedict, word2number).
SDIST_ONLY = ("rouge-score", "sqlitedict", "word2number")


def extra(name: str) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"][name]


def kept_pins(lock: Path) -> list[str]:
    """`name==version` of every package `lock` pins: constraints of its re-resolution, so a
    package added to an extra changes no other pin."""
    if not lock.exists():
        return []
    return [line.split()[0] for line in lock.read_text().splitlines() if "==" in line and not line.startswith("#")]


def resolve(requirements: list[str], python: str, keep: list[str] = (), wheelhouse: str = "") -> list[dict]:
    """pip's report of what it would install for `python` (e.g. '3.12') on linux x86_64,
    within the pins `keep` (constraints), with the wheels in `wheelhouse` (if any) beside PyPI's."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("".join(f"{pin}\n" for pin in keep))
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
             "--only-binary=:all:", f"--python-version={python}", f"--platform={PLATFORM}",
             "--platform=manylinux2014_x86_64", "--platform=linux_x86_64",
             f"--target={tmp}/target", "--report", str(report), "--constraint", str(constraints),
             *([f"--find-links={wheelhouse}"] if wheelhouse else []), *requirements],
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
    locks = [ROOT / "requirements" / f"trainer-py{python.replace('.', '')}.lock.txt" for python in TRAINER_PYTHONS]
    # A pure-Python package PyPI has only as an sdist (--only-binary refuses it, and a
    # platform resolution takes nothing else): built once as a wheel, which serves every
    # Python, so the resolution sees it and what it requires; pinned by its sdist's hash.
    # Each at the extra's pin, else the locks', else the newest.
    pins = {pin.split("==")[0]: pin for pin in [*(p for lock in locks for p in kept_pins(lock)), *wanted]}
    sources = [pins.get(name, name) for name in SDIST_ONLY]
    sdists = {s["metadata"]["name"].lower().replace("_", "-"): s for s in map(resolve_sdist, sources)}
    with tempfile.TemporaryDirectory() as wheelhouse:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-binary=:all:",
                        f"--wheel-dir={wheelhouse}", *(f"{name}=={s['metadata']['version']}"
                                                       for name, s in sdists.items())], check=True)
        for python, path in zip(TRAINER_PYTHONS, locks):
            keep = kept_pins(path) + [f"{name}=={s['metadata']['version']}" for name, s in sdists.items()]
            resolved = resolve(wanted, python, list(dict.fromkeys(keep)), wheelhouse)
            installs = [sdists.get(i["metadata"]["name"].lower().replace("_", "-"), i) for i in resolved]
            _write_trainer_lock(path, python, installs)


def _write_trainer_lock(path: Path, python: str, installs: list[dict]) -> None:
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
