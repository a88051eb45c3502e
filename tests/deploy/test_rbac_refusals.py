"""The end-to-end suite's "zero Forbidden" proof only means something if a missing rule
shows up in the operator's log. Here the operator runs with deploy/'s roles minus
one rule (under another ServiceAccount, watching an empty namespace so it touches nothing
of other tests), and the refusal must appear."""

from __future__ import annotations

import copy
from datetime import datetime

import pytest
import yaml

from harness.operator_process import OperatorProcess
from harness.service_account import (DEPLOY_BASE, RUNS_ROLE, rbac_objects, refusals, refused_after_deletion,
                                     service_account_kubeconfig)
from harness.waiting import wait_for


REFUSED_EVENT = ('[2026-12-07 02:19:38,819] kopf._core.engines.p [ERROR   ] Request attempt #9/9 failed; '
                 'escalating: POST https://127.0.0.1:24835/api/v1/namespaces/t-run-a1/events -> '
                 'APIForbiddenError(\'events is forbidden: User "system:serviceaccount:tpufinetune-system:'
                 'tpufinetune-operator" cannot create resource "events" in API group "" in the namespace "t-run-a1"\')')
GAVE_UP = ('[2026-12-07 02:19:38,819] kopf._core.engines.p [WARNING ] Failed to post an event. Ignoring and '
           'continuing. Code: 403. Message: events is forbidden: User "system:serviceaccount:x:y" cannot create '
           'resource "events" in API group "" in the namespace "t-run-a1". Details: {}')


@pytest.mark.parametrize("line", [REFUSED_EVENT, GAVE_UP])
def test_a_refusal_counts_unless_its_namespace_was_being_deleted_when_it_was_logged(line, tmp_path):
    """The namespace controller deletes the operator's RoleBinding of a namespace being
    deleted: a refusal there afterwards is not a missing rule. Before the deletion, in
    another namespace, or at a time the log does not give, it still counts."""
    log = tmp_path / "operator.log"
    log.write_text(line + "\n")
    assert refusals(log) == [line]
    assert refusals(log, {"t-run-a1": datetime(2026, 12, 7, 2, 19, 38, 819000)}) == []
    assert refusals(log, {"t-run-a1": datetime(2026, 12, 7, 2, 19, 39)}) == [line]
    assert refusals(log, {"t-run-a2": datetime(2026, 12, 7, 2, 0)}) == [line]
    assert not refused_after_deletion(line.split("] ", 1)[1], {"t-run-a1": datetime(2026, 12, 7, 2, 0)})


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


@pytest.mark.cluster
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


@pytest.mark.cluster
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
