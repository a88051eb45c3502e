"""The ground's dynamic volume provisioner, an external provisioner as GKE's CSI drivers are:
the StorageClass `standard-rwx` (the cluster's default) makes, for each claim of it, a
PersistentVolume whose storage is a directory of the ground's workdir (`hostPath`), and
deletes that directory when the released volume's reclaim policy is Delete.

It only creates and deletes PersistentVolumes: the real kube-controller-manager's
persistentvolume-binder binds claim and volume (and annotates the claim with this
provisioner's name, which is how it finds the claims to serve), as on any cluster.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("provisioner")

NAME = "ground.tpufinetune.dev/hostpath"
STORAGE_CLASS = "standard-rwx"
_PROVISIONER_ANNOTATION = "volume.kubernetes.io/storage-provisioner"


def volume_name(claim_uid: str) -> str:
    return f"pvc-{claim_uid}"  # as external-provisioner names them


def volume_manifest(claim: dict, path: Path, reclaim: str) -> dict:
    meta, spec = claim["metadata"], claim["spec"]
    return {
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": volume_name(meta["uid"]), "annotations": {"pv.kubernetes.io/provisioned-by": NAME}},
        "spec": {
            "capacity": {"storage": spec["resources"]["requests"]["storage"]},
            "accessModes": spec["accessModes"],
            "persistentVolumeReclaimPolicy": reclaim,
            "storageClassName": spec.get("storageClassName") or STORAGE_CLASS,
            "volumeMode": spec.get("volumeMode") or "Filesystem",
            "hostPath": {"path": str(path), "type": "Directory"},
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"],
                         "name": meta["name"], "uid": meta["uid"]},
        },
    }


class Provisioner:
    def __init__(self, api: client.ApiClient, root: Path, interval: float = 1.0):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.storage = client.StorageV1Api(api)
        self.root = root
        self.interval = interval

    def install(self) -> None:
        """The StorageClass, marked the default one (a claim without a class gets it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        body = {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
                "metadata": {"name": STORAGE_CLASS,
                             "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
                "provisioner": NAME, "reclaimPolicy": "Delete", "volumeBindingMode": "Immediate"}
        try:
            self.storage.create_storage_class(body)
        except ApiException as error:
            if error.status != 409:
                raise

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.sync()
            except Exception as error:  # the API server restarting: next round
                log.warning("provisioner: %s", error)
            stop.wait(self.interval)

    def sync(self) -> None:
        classes = {c.metadata.name: c for c in self.storage.list_storage_class().items if c.provisioner == NAME}
        volumes = {pv.metadata.name: pv for pv in self.core.list_persistent_volume().items}
        for claim in self.core.list_persistent_volume_claim_for_all_namespaces().items:
            wanted = (claim.metadata.annotations or {}).get(_PROVISIONER_ANNOTATION) == NAME
            storage_class = classes.get(claim.spec.storage_class_name or "")
            if (wanted and storage_class is not None and not claim.spec.volume_name
                    and claim.metadata.deletion_timestamp is None and volume_name(claim.metadata.uid) not in volumes):
                self.provision(self.api.sanitize_for_serialization(claim), storage_class.reclaim_policy or "Delete")
        for pv in volumes.values():
            if ((pv.metadata.annotations or {}).get("pv.kubernetes.io/provisioned-by") == NAME
                    and pv.status.phase == "Released" and pv.spec.persistent_volume_reclaim_policy == "Delete"):
                self.delete(pv)

    def provision(self, claim: dict, reclaim: str) -> None:
        path = self.root / volume_name(claim["metadata"]["uid"])
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o777)  # any pod user may write, as a fresh filesystem's root
        try:
            self.core.create_persistent_volume(volume_manifest(claim, path, reclaim))
            log.info("provisioned %s for %s/%s", path.name, claim["metadata"]["namespace"], claim["metadata"]["name"])
        except ApiException as error:
            if error.status != 409:
                raise

    def delete(self, pv) -> None:
        path = Path(pv.spec.host_path.path)
        if path.parent == self.root:  # only what it made
            shutil.rmtree(path, ignore_errors=True)
        try:
            self.core.delete_persistent_volume(pv.metadata.name)
        except ApiException as error:
            if error.status != 404:
                raise
