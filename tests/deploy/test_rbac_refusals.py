"""The end-to-end suite's "zero Forbidden" proof only means something if a missing rule
shows up in the operator's log. Here the operator runs with deploy/'s roles minus
one rule (under another ServiceAccount, watching an empty namespace so it touches nothing
of other tests), and the refusal must appear."""

from __future__ import annotations

import copy

import pytest
import yaml

from harness.operator_process import OperatorProcess
from harness.service_account import DEPLOY_BASE, RUNS_ROLE, rbac_objects, refusals, service_account_kubeconfig
from harness.waiting import wait_for

pytestmark = pytest.mark.cluster


def narrowed(objects: list[dict], without: str, namespace: str) -> list[dict]:
    """deploy/base's two operator ClusterRoles (cluster reads; the runs' rules, bound in
    `namespace`) less the rules on `without`, for another ServiceAccount."""
    # The operator's own roles only: the aggregated edit/view roles are for users.
    # (and no leader election: these operators run alone, without the Lease's Role).
    names = {"tpufinetune-operator": "tpufinetune-narrow", RUNS_ROLE: "tpufinetune-narrow-runs"}
    objects = copy.deepcopy([o for o in objects if o["kind"] not in ("ClusterRole", "Role", "RoleBinding")
                             or o["metadata"]["name"] in names])
    for obj in objects:
        if obj["kind"] == "Namespace":
            continue
        if obj["kind"] == "ClusterRole":
            obj["metadata"]["name"] = names[obj["metadata"]["name"]]
            obj["rules"] = [r for r in obj["rules"] if without not in r["resources"]]
        else:
            obj["metadata"]["name"] = "tpufinetune-narrow"
        if obj["kind"] == "ClusterRoleBinding":
            obj["roleRef"]["name"] = "tpufinetune-narrow"
            obj["subjects"][0]["name"] = "tpufinetune-narrow"
    account = next(o["metadata"] for o in objects if o["kind"] == "ServiceAccount")
    objects.append({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                    "metadata": {"name": "tpufinetune-narrow", "namespace": namespace},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                "name": "tpufinetune-narrow-runs"},
                    "subjects": [{"kind": "ServiceAccount", "name": "tpufinetune-narrow",
                                  "namespace": account["namespace"]}]})
    return objects


def test_a_rule_taken_away_shows_up_as_a_refusal_in_the_operator_log(control_plane, namespace, tmp_path):
    rbac = narrowed(rbac_objects(control_plane, DEPLOY_BASE), "customresourcedefinitions", namespace)
    env = control_plane.env()
    env.update(KUBECONFIG=str(service_account_kubeconfig(control_plane, tmp_path / "kubeconfig", rbac)),
               TPUFT_NAMESPACE=namespace, TPUFT_LEADER_ELECTION="false")
    process = OperatorProcess(env, tmp_path / "operator.log")
    process.start()
    try:
        wait_for(lambda: any("customresourcedefinitions" in line for line in refusals(process.log_path)), 60,
                 "a refusal of customresourcedefinitions in the operator log", details=process.log_tail)
    finally:
        process.stop()


def test_without_the_workloads_rule_a_queued_run_is_refused_reading_kueues_workload(
        control_plane, kuberay_crd, namespace, tmp_path):
    """The Kueue rule (list workloads) is used, and only by a queued run: with it taken away,
    a TPUFineTune with spec.queueName makes the operator's Workload read refused. Kueue need
    not run: the operator creates the RayCluster suspended and asks why it waits."""
    rbac = narrowed(rbac_objects(control_plane, DEPLOY_BASE), "workloads", namespace)
    env = control_plane.env()
    env.update(KUBECONFIG=str(service_account_kubeconfig(control_plane, tmp_path / "kubeconfig", rbac)),
               TPUFT_NAMESPACE=namespace, TPUFT_LEADER_ELECTION="false")
    process = OperatorProcess(env, tmp_path / "operator.log")
    process.start()
    try:
        control_plane.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump({
            "apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": "queued"},
            "spec": {"tpu": {"generation": "cpu", "topology": "1"}, "image": "example/trainer:1",
                     "checkpoint": {"storagePath": "gs://tpufinetune-ground/never"}, "queueName": "tpu-queue"}}))
        wait_for(lambda: any("workloads" in line for line in refusals(process.log_path)), 60,
                 "a refusal of workloads in the operator log", details=process.log_tail)
    finally:
        control_plane.kubectl("-n", namespace, "delete", "tpufinetune", "queued", "--wait=false", check=False)
        process.stop()
