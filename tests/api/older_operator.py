"""An older operator package, taken from this clone's history, and a probe run on it in a
process of its own: the version-skew tests' rollback (test_version_skew, test_generation_api)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def extract(commit: str, out: Path, what: str) -> Path:
    """operator/tpufinetune at `commit`, unpacked under `out`; the PYTHONPATH entry that
    imports it. `what` names it when the clone lacks that history."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "operator/tpufinetune"],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.fail(f"the {what} operator is not in this clone ({archive.stderr.decode().strip()}); "
                    "fetch its history (`git fetch --unshallow`)", pytrace=False)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out / "operator"


def run(operator: Path, probe: str, *args: str):
    """`probe` (Python that prints one JSON value) run with the older package first on the path."""
    older = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True,
                           env={"PYTHONPATH": str(operator), "PATH": "/usr/bin:/bin"}, check=True)
    return json.loads(older.stdout)


# What an older operator makes of a spec: the fields it ignores (an unknown field after a
# rollback), what its condition says of them, and the trainer argv it would submit.
READ_SPEC = ("import json, sys\nfrom tpufinetune.core.api import parse_stored_spec\n"
             "from tpufinetune.core.jobspec import trainer_argv\n"
             "from tpufinetune.core.skew import ignored_fields_message\n"
             "parsed, ignored = parse_stored_spec(json.loads(sys.argv[1]))\n"
             "print(json.dumps({'ignored': list(ignored), 'says': ignored_fields_message(ignored),\n"
             "                  'argv': trainer_argv(parsed)}))\n")


def reads(operator: Path, spec: dict) -> dict:
    """How the older `operator` reads `spec`: {ignored, says, argv} (READ_SPEC)."""
    return run(operator, READ_SPEC, json.dumps(spec))
