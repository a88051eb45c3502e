"""Golden tests: the GKE Ray + TorchTPU tutorial's two RayCluster manifests, field by field.

The tutorial YAML below is copied from the tutorial (only `${IMAGE_URI}` substituted).
`operator_additions` lists, explicitly, everything the operator adds on top; nothing else
may differ.
"""
from __future__ import annotations

import yaml
from api_spec_cases import IMAGE

from tpufinetune.core.api import parse_spec
from tpufinetune.core.sizing import (
    DEFAULT_TERMINATION_GRACE_SECONDS, NOTICE_ENV, PRE_STOP_SCRIPT, SHUTDOWN_ENV, render_raycluster,
)

UID = "6f1c2a7e-0b1d-4c55-9a57-3c1e0d2b8f10"

TUTORIAL_V6E = """
apiVersion: ray.io/v1
kind: RayCluster
metadata:
  name: ray-torchtpu-cluster
spec:
  headGroupSpec:
    rayStartParams:
      num-cpus: "0"
    template:
      spec:
        containers:
        - name: ray-head
          image: ${IMAGE_URI}
          env:
          - name: HF_TOKEN
            valueFrom:
              secretKeyRef:
                name: hf-secret
                key: hf_api_token
          ports:
          - containerPort: 6379
            name: gcs
          - containerPort: 8265
            name: dashboard
          - containerPort: 10001
            name: client
          resources:
            limits:
              cpu: "4"
              memory: "16Gi"
            requests:
              cpu: "4"
              memory: "16Gi"
  workerGroupSpecs:
  - groupName: v6e-16
    replicas: 1
    numOfHosts: 4
    template:
      spec:
        containers:
        - name: ray-worker
          image: ${IMAGE_URI}
          env:
          - name: HF_TOKEN
            valueFrom:
              secretKeyRef:
                name: hf-secret
                key: hf_api_token
          resources:
            limits:
              cpu: "64"
              memory: "200Gi"
              google.com/tpu: "4"
            requests:
              cpu: "64"
              memory: "200Gi"
              google.com/tpu: "4"
          volumeMounts:
          - mountPath: /dev/shm
            name: dshm
        volumes:
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: 100Gi
        nodeSelector:
          cloud.google.com/gke-tpu-accelerator: tpu-v6e-slice
          cloud.google.com/gke-tpu-topology: 4x4
"""

TUTORIAL_V7X = """
apiVersion: ray.io/v1
kind: RayCluster
metadata:
  name: ray-torchtpu-cluster
spec:
  headGroupSpec:
    rayStartParams:
      num-cpus: "0"
    template:
      spec:
        containers:
        - name: ray-head
          image: ${IMAGE_URI}
          env:
          - name: HF_TOKEN
            valueFrom:
              secretKeyRef:
                name: hf-secret
                key: hf_api_token
          - name: RAY_TPU_RESOURCE_PER_CHIP
            value: "2"
          ports:
          - containerPort: 6379
            name: gcs
          - containerPort: 8265
            name: dashboard
          - containerPort: 10001
            name: client
          resources:
            limits:
              cpu: "4"
              memory: "16Gi"
            requests:
              cpu: "4"
              memory: "16Gi"
  workerGroupSpecs:
  - groupName: tpu7x-16
    replicas: 1
    numOfHosts: 2
    resources:
      # Advertises 8 logical TPU cores (2 chiplets per physical chip) per host.
      TPU: "8"
    template:
      spec:
        containers:
        - name: ray-worker
          image: ${IMAGE_URI}
          env:
          - name: HF_TOKEN
            valueFrom:
              secretKeyRef:
                name: hf-secret
                key: hf_api_token
          - name: RAY_TPU_RESOURCE_PER_CHIP
            value: "2"
          resources:
            limits:
              cpu: "64"
              memory: "250Gi"
              google.com/tpu: "4"
            requests:
              cpu: "64"
              memory: "250Gi"
              google.com/tpu: "4"
          volumeMounts:
          - mountPath: /dev/shm
            name: dshm
        volumes:
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: 128Gi
        nodeSelector:
          cloud.google.com/gke-tpu-accelerator: tpu7x
          cloud.google.com/gke-tpu-topology: 2x2x2
"""


def tutorial(text: str) -> dict:
    return yaml.safe_load(text.replace("${IMAGE_URI}", IMAGE))


def operator_additions(manifest: dict, name: str) -> dict:
    """The tutorial manifest plus exactly what the operator adds."""
    manifest["metadata"] = {
        "name": f"tft-{name}",
        "namespace": "ml",
        "labels": {"app.kubernetes.io/managed-by": "tpufinetune", "tpufinetune.dev/name": name},
        "ownerReferences": [{"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune",
                             "name": name, "uid": UID, "controller": True,
                             "blockOwnerDeletion": True}],
    }
    manifest["spec"]["rayVersion"] = "2.60.0"
    # Ray token authentication with the run's own token, from its own Secret (raytoken.py).
    manifest["spec"]["authOptions"] = {"mode": "token", "secretName": f"tft-{name}-ray-token-{UID[:8]}"}
    for group in manifest["spec"]["workerGroupSpecs"]:
        # A fixed-size slice: KubeRay's autoscaler must neither add nor remove hosts.
        group["minReplicas"] = group["maxReplicas"] = group["replicas"]
    # Checkpoint on notice: a grace period, the preStop hook and its directory; and no Serve
    # drain on SIGTERM (sizing.py).
    for template in [manifest["spec"]["headGroupSpec"]["template"],
                     *[group["template"] for group in manifest["spec"]["workerGroupSpecs"]]]:
        # Every pod carries the labels the operator's pod watch selects on (informer.py).
        template["metadata"] = {"labels": {"app.kubernetes.io/managed-by": "tpufinetune",
                                           "tpufinetune.dev/name": name}}
        template["spec"]["terminationGracePeriodSeconds"] = DEFAULT_TERMINATION_GRACE_SECONDS
        container = template["spec"]["containers"][0]
        container["env"] = container.get("env", []) + NOTICE_ENV + SHUTDOWN_ENV
        container["lifecycle"] = {"preStop": {"exec": {"command": ["/bin/sh", "-c", PRE_STOP_SCRIPT]}}}
    return manifest


def render(generation: str, topology: str, name: str) -> dict:
    spec = parse_spec({
        "tpu": {"generation": generation, "topology": topology},
        "image": IMAGE,
        "model": {"tokenSecret": {"name": "hf-secret", "key": "hf_api_token"}},
        "checkpoint": {"storagePath": "gs://my-bucket/ray_train_torchtpu"},
    })
    return render_raycluster(name, "ml", UID, spec)


def test_v6e_4x4_reproduces_the_tutorial_manifest():
    expected = operator_additions(tutorial(TUTORIAL_V6E), "gemma-v6e")
    assert render("v6e", "4x4", "gemma-v6e") == expected


def test_v7x_2x2x2_reproduces_the_tutorial_manifest():
    expected = operator_additions(tutorial(TUTORIAL_V7X), "gemma-v7x")
    assert render("v7x", "2x2x2", "gemma-v7x") == expected


def test_aliases_render_identically():
    assert render("trillium", "4x4", "x") == render("v6e", "4x4", "x")
    assert render("ironwood", "2x2x2", "x") == render("tpu7x", "2x2x2", "x") == render(
        "v7x", "2x2x2", "x")


def test_tutorial_outputs_pass_kuberay_schema_and_tpu_webhook(kuberay_schema, webhook_refusal):
    for manifest in (render("v6e", "4x4", "a"), render("v7x", "2x2x2", "b")):
        assert kuberay_schema.problems(manifest) == []
        assert webhook_refusal(manifest) is None
