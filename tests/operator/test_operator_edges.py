"""Edges of the operator on real parts: a RayCluster it does not own, and `run --local`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tpufinetune.core import conditions as cond
from tpufinetune.core.api import parse_spec
from tpufinetune.core.sizing import render_raycluster


@pytest.mark.cluster
def test_a_raycluster_it_does_not_own_is_refused_with_a_condition_and_left_alone(operator, kube):
    spec = {"tpu": {"generation": "cpu", "topology": "1"}, "image": "registry.example/t:1",
            "checkpoint": {"storagePath": "gs://tpufinetune-ground/taken"}}
    foreign = render_raycluster("taken", kube.ns, "00000000-0000-0000-0000-000000000001", parse_spec(spec))
    del foreign["metadata"]["ownerReferences"]
    kube.apply(foreign)
    foreign_uid = kube.get("raycluster", "tft-taken")["metadata"]["uid"]

    kube.apply({"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune",
                "metadata": {"name": "taken"}, "spec": spec})

    def refused():
        return (cond.find(kube.status("taken"), cond.CLUSTER_READY) or {}).get("reason") == "NotOwned"

    kube.wait_for(refused, "ClusterReady=False reason NotOwned", timeout=60)
    assert "not owned" in kube.status("taken")["message"]
    kube.kubectl("delete", "tpufinetune", "taken", "--wait=true", "--timeout=60s", timeout=70)
    left = kube.get("raycluster", "tft-taken")
    assert left["metadata"]["uid"] == foreign_uid
    assert not left["metadata"].get("ownerReferences")


@pytest.mark.ray
def test_run_local_drives_the_same_state_machine_on_a_local_ray_head(ray_head, tmp_path):
    spec_file = tmp_path / "collectives.yaml"
    spec_file.write_text(yaml.safe_dump({
        "apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": "local-check"},
        "spec": {"tpu": {"generation": "cpu", "topology": "2"}, "mode": "collectives",
                 "image": "registry.example/t:1"},
    }))
    env = ray_head.env()
    env["TPUFT_RAY_TOKEN"] = ray_head.token or ""
    result = subprocess.run(
        [sys.executable, "-m", "tpufinetune.cli", "run", "--local", str(spec_file), "--address", ray_head.dashboard_url],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    phases = [line.split("phase=")[1].split()[0] for line in result.stdout.splitlines() if "phase=" in line]
    assert phases == ["Pending", "Provisioning", "Submitting", "Running", "Succeeded"]
    final = yaml.safe_load(result.stdout[result.stdout.index("status:"):])["status"]
    assert final["collectives"]["passed"] is True and final["collectives"]["ranks"] == 2


def test_run_local_refuses_an_invalid_spec_before_touching_ray(tmp_path):
    spec_file = tmp_path / "bad.yaml"
    spec_file.write_text(yaml.safe_dump({
        "apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": "bad"},
        "spec": {"tpu": {"generation": "v6e", "topology": "3x3"}, "image": "x", "checkpoint": {"storagePath": "gs://b"}},
    }))
    result = subprocess.run(
        [sys.executable, "-m", "tpufinetune.cli", "run", "--local", str(spec_file), "--address", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert "spec.tpu.topology" in result.stdout and "phase=Failed" in result.stdout
