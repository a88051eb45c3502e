"""`tpufinetune run --local` and a chained run (spec.model.initFrom): there is no cluster to read
its source from, so it is refused at once, saying why and what to do, rather than waiting
forever for a source it can never read."""
from __future__ import annotations

import subprocess
import sys

import yaml


def test_run_local_refuses_a_chained_run_at_once(tmp_path):
    spec_file = tmp_path / "dpo.yaml"
    spec_file.write_text(yaml.safe_dump({
        "apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": "dpo"},
        "spec": {"tpu": {"generation": "cpu", "topology": "2"}, "image": "registry.example/t:1",
                 "model": {"initFrom": {"run": "sft"}}, "checkpoint": {"storagePath": "gs://b/runs"}},
    }))
    result = subprocess.run(
        [sys.executable, "-m", "tpufinetune.cli", "run", "--local", str(spec_file), "--address", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "spec.model.initFrom" in result.stderr and "kubectl" in result.stderr, result.stderr
    assert "status.exportedModelURI" in result.stderr and "phase=" not in result.stdout
