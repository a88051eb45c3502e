"""On TPU, setup_device makes the worker's own chip the process's device, from its local
rank, before the device mesh would pick one itself. No TPU here: torch's `tpu` device type
is registered as torch_tpu registers it (privateuse1 renamed) in a separate process, the
runtime's import is skipped, and the accelerator API's calls are observed (a process that
sees four chips, or one) rather than forced on a device that is not there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, sys
import torch
from tpufinetune_trainer import backends
torch.utils.rename_privateuse1_backend("tpu")  # what torch_tpu's import does first
results = []
for visible, local_rank in json.loads(sys.argv[1]):
    calls = []
    backends.load_tpu_runtime = lambda *a: calls.append(("load_tpu_runtime",))
    torch.accelerator.device_count = lambda: calls.append(("device_count",)) or visible
    torch.accelerator.set_device_index = lambda index: calls.append(("set_device_index", index))
    try:
        device = backends.setup_device(backends.BACKENDS["tpu"], local_rank)
        out = {"device": str(device), "index": device.index}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["calls"] = calls
    out["torch_tpu_imported"] = "torch_tpu" in sys.modules
    results.append(out)
print(json.dumps(results))
"""
CASES = [(4, 2, 2), (4, 0, 0), (1, 3, 0)]
REFUSED = (2, 3)


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    """Every case's outcome, from one process (torch's import is most of its time)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    cases = [[visible, local_rank] for visible, local_rank, _ in CASES] + [list(REFUSED)]
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases)], env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_workers_chip_is_set_from_its_local_rank(outcomes, case):
    _, _, index = CASES[case]
    out = outcomes[case]
    assert out.get("device") == f"tpu:{index}", out
    assert ("set_device_index", index) in [tuple(c) for c in out["calls"]], out
    assert out["calls"][0] == ["load_tpu_runtime"] and not out["torch_tpu_imported"], out


def test_a_local_rank_with_no_chip_of_its_own_is_refused_naming_both(outcomes):
    out = outcomes[-1]
    assert out.get("error", "").startswith("ConfigError: worker with local rank 3 sees 2 TPU device(s)"), out
    assert ["set_device_index", 3] not in out["calls"], out
