"""`pip install tpufinetune` (pydantic and PyYAML only) gives the API models, validation,
`tpufinetune render` and the CRD generator: run them with every heavier package refused."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.abc, io, sys, contextlib
from pathlib import Path
HEAVY = {"kopf", "kubernetes", "ray", "torch", "numpy", "prometheus_client", "aiohttp",
         "transformers", "datasets", "tpufinetune_trainer"}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ImportError(f"{name} is not in the light install")
sys.meta_path.insert(0, Refuse())
from tpufinetune import cli, crdgen
root = Path(sys.argv[1])
samples = sorted((root / "deploy" / "samples").glob("*.yaml"))
for sample in samples:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["render", str(sample)]) == 0, sample
    assert "kind: RayCluster" in out.getvalue(), sample
assert crdgen.crd_yaml() == (root / "crds" / "tpufinetunes.tpufinetune.dev.yaml").read_text()
print(f"ok {len(samples)} samples, CRD identical, Python {sys.version_info[0]}.{sys.version_info[1]}")
"""


def light_core_check(python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-c", SCRIPT, str(ROOT)], capture_output=True, text=True,
                          timeout=120)


def test_render_and_the_crd_need_only_pydantic_and_pyyaml():
    result = light_core_check()
    assert result.returncode == 0, result.stderr[-3000:]
    shipped = len(list((ROOT / "deploy" / "samples").glob("*.yaml")))
    assert shipped >= 8
    assert result.stdout.startswith(f"ok {shipped} samples, CRD identical"), result.stdout
