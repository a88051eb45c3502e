"""Thin Kubernetes adapter: the RayCluster a run owns, and the run's status writes.

Blocking client calls run in the backend's own pool of threads (TPUFT_KUBE_THREADS), so
one slow API call never stalls other runs, and Ray calls (another pool) never hold them up.
An answer 429 Too Many Requests is waited out (its Retry-After) and the call repeated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from datetime import datetime, timezone

import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException

from tpufinetune.core.errors import CreateRefused, StatusConflict
from tpufinetune.core import podstatus, retryafter
from tpufinetune.core.api import GROUP, PLURAL, VERSION
from tpufinetune.core.phases import ClusterView, Identity, QueueView
from tpufinetune.core.sizing import NAME_LABEL, POD_SELECTOR, QUEUE_NAME_LABEL
from tpufinetune.adapters import informer, lease
from tpufinetune.adapters.kubeviews import (  # noqa: F401  (re-exported: the handlers and tests use kube.X)
    CLUSTER_LABEL, JOB_UID_LABEL, KUEUE_GROUP, KUEUE_VERSION, MAINTENANCE_LABEL, NO_KUEUE, RAY_GROUP, RAY_PLURAL,
    RAY_VERSION, WORKLOADS, api_answer, cluster_view, queue_view, server_message,
)
from tpufinetune.adapters.pools import Pool
from tpufinetune.adapters.raytokens import RayTokens, SigningKeyError
from tpufinetune.settings import Settings

log = logging.getLogger(__name__)


# A cluster the operator created is looked up with a GET, not taken as missing, while the
# watch may not have delivered it yet.
CREATED_GRACE_S = 30.0


# Without the watches (not started yet, or not synced after a restart), a cluster that
# waits has its pods or its Workload read at most this often (the scheduler's or Kueue's
# message changes slowly); a change of the RayCluster reads again. Also for a RayCluster
# an older version created, whose pods lack the label the pod watch selects on.
RECHECK_S = 30.0
# How long an observation waits for the watches' first list after a start before it
# reads the API server itself.
SYNC_WAIT_S = 5.0


class Watches:
    """The operator's three list-then-watch caches (adapters/informer.py): its RayClusters
    (label tpufinetune.dev/name), their pods (label app.kubernetes.io/managed-by=tpufinetune,
    set on every pod template), and Kueue's Workloads. RBAC: list and watch on each."""

    def __init__(self, api: client.ApiClient, settings: Settings, on_change):
        objects, core, namespace = client.CustomObjectsApi(api), client.CoreV1Api(api), settings.one_namespace
        self.clusters = informer.Store(informer.project_raycluster)
        self.pods = informer.Store(informer.project_pod, index=lambda pod: _labels(pod).get(CLUSTER_LABEL))
        self.workloads = informer.Store(informer.project_workload,
                                        index=lambda workload: _labels(workload).get(JOB_UID_LABEL))
        if namespace:
            lists = (functools.partial(objects.list_namespaced_custom_object, RAY_GROUP, RAY_VERSION, namespace,
                                       RAY_PLURAL),
                     functools.partial(core.list_namespaced_pod, namespace),
                     functools.partial(objects.list_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION,
                                       namespace, WORKLOADS))
        else:
            lists = (functools.partial(objects.list_cluster_custom_object, RAY_GROUP, RAY_VERSION, RAY_PLURAL),
                     core.list_pod_for_all_namespaces,
                     functools.partial(objects.list_cluster_custom_object, KUEUE_GROUP, KUEUE_VERSION, WORKLOADS))
        timeout = settings.kube_timeout
        self.started = float("-inf")
        self.informers = (
            informer.Informer(RAY_PLURAL, lists[0], self.clusters, on_change, timeout, label_selector=NAME_LABEL),
            informer.Informer("pods", lists[1], self.pods, on_change, timeout, label_selector=POD_SELECTOR),
            informer.Informer(WORKLOADS, lists[2], self.workloads, on_change, timeout),
        )

    def start(self) -> None:
        self.started = time.monotonic()
        for each in self.informers:
            each.start()

    def stop(self) -> None:
        for each in self.informers:
            each.stop()

    def owner(self, kind: str, item: dict) -> str | None:
        """The TPUFineTune a changed object belongs to (its name, in the object's namespace)."""
        if kind == WORKLOADS:
            meta = item.get("metadata") or {}
            for ref in meta.get("ownerReferences") or []:
                cluster = self.clusters.get(meta.get("namespace", ""), ref.get("name", ""))
                if ref.get("kind") == "RayCluster" and cluster is not None:
                    return _labels(cluster).get(NAME_LABEL)
            return None
        return _labels(item).get(NAME_LABEL)


def _labels(item: dict) -> dict:
    return (item.get("metadata") or {}).get("labels") or {}


class Throttled:
    """Answers 429 are normal under load (API Priority and Fairness): logged at most once
    per `every` seconds, with how many calls waited, never once per call."""

    def __init__(self, every: float = 30.0):
        self.every = every
        self.count = 0  # calls answered 429 since the process started
        self._since_log = 0
        self._logged = float("-inf")

    def saw(self, wait: float) -> None:
        self.count += 1
        self._since_log += 1
        now = time.monotonic()
        if now - self._logged >= self.every:
            log.info("the API server answered 429 Too Many Requests to %d call(s); each waits its "
                     "Retry-After (now %gs) and is sent again", self._since_log, wait)
            self._logged, self._since_log = now, 0


def finalizer_removal(finalizers: list[str], finalizer: str) -> list[dict]:
    """A JSON patch that removes `finalizer` from `finalizers` only if the list is still
    that list (a merge patch would replace it whole, dropping another writer's newer entry);
    none when it is not there."""
    if finalizer not in finalizers:
        return []
    return [{"op": "test", "path": "/metadata/finalizers", "value": finalizers},
            {"op": "replace", "path": "/metadata/finalizers", "value": [f for f in finalizers if f != finalizer]}]


class KubeBackend:
    def __init__(self, api: client.ApiClient, settings: Settings, watches: Watches | None = None):
        self.objects = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.settings = settings
        # None: every observation reads the API server (throttled as RECHECK_S says).
        self.watches = watches
        self.pool = Pool("kube", settings.kube_threads)
        self.throttled = Throttled()
        self.throttle_budget = retryafter.BUDGET_S  # seconds one call may wait out 429s
        self._checks: dict[tuple[str, str], tuple] = {}  # (kind, cluster uid) -> (version, when, value)
        self._created: dict[tuple[str, str], float] = {}  # (namespace, name) -> when we created it
        # RayClusters a create found there and not ours (409): looked up with a GET while
        # they stay, since the watch sees only labelled ones (a foreign one may have none).
        self._foreign: set[tuple[str, str]] = set()
        # Every call, connect and answer: an API server that never answers holds one
        # worker thread for this long, never a run for ever.
        self._timeout = (settings.kube_timeout, settings.kube_timeout)
        self.tokens = RayTokens(api, settings.operator_namespace, self._timeout)
        # Nodes carrying the maintenance label, from the node watch (handlers.node_maintenance).
        self.maintenance_nodes: dict[str, str] = {}

    @property
    def watched(self) -> bool:
        """A change to a run's RayCluster, its pods or its Workload wakes the run (the
        watches of adapters/informer.py): a waiting run need not poll."""
        return self.watches is not None

    async def _call(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` (blocking) in the Kubernetes pool. A 429 Too Many Requests
        was not processed: wait its Retry-After (here, holding no thread) and call again,
        up to retryafter.BUDGET_S of waiting; then the 429 is the caller's error."""
        waited = 0.0
        while True:
            try:
                return await self.pool.call(fn, *args, **kwargs)
            except ApiException as error:
                if error.status != 429:
                    raise
                header = error.headers.get("Retry-After") if error.headers else None
                wait = retryafter.next_wait(header, waited, datetime.now(timezone.utc), self.throttle_budget)
                if wait is None:
                    raise
                self.throttled.saw(wait)
                await asyncio.sleep(wait)
                waited += wait

    async def _synced(self, store: informer.Store | None) -> bool:
        """The watch's store is complete (its first list is in). In the first SYNC_WAIT_S
        after the watches started, waits for it rather than read the API server for every
        run; later (a watch that cannot list: RBAC, an API server away) it does not wait."""
        if store is None:
            return False
        while not store.synced.is_set() and time.monotonic() < self.watches.started + SYNC_WAIT_S:
            await asyncio.sleep(0.1)
        return store.synced.is_set()

    async def _cluster(self, namespace: str, name: str) -> dict | None:
        """The RayCluster, projected; from the watch when it is synced. A miss is a GET only
        for a cluster created moments ago (the watch may not have delivered it yet)."""
        store = self.watches.clusters if self.watches else None
        if await self._synced(store):
            body = store.get(namespace, name)
            created = self._created.get((namespace, name))
            foreign = (namespace, name) in self._foreign
            if body is not None or not foreign and (created is None or time.monotonic() - created > CREATED_GRACE_S):
                return body
        body = await self._call(self._get_cluster, namespace, name)
        if body is None:
            self._foreign.discard((namespace, name))
        return informer.project_raycluster(body) if body is not None else None

    async def _pods(self, namespace: str, cluster: dict) -> list[dict]:
        """The cluster's pods: from the pod watch when it is synced and the cluster's pods
        carry its label; else a LIST at most every RECHECK_S per version of the cluster."""
        store = self.watches.pods if self.watches else None
        name = cluster["metadata"]["name"]
        if cluster.get("podsLabelled") and await self._synced(store):
            return store.indexed(namespace, name)
        return await self._every(("pods", cluster["metadata"]), lambda: self._cluster_pods(namespace, name))

    async def _queue(self, namespace: str, cluster: dict) -> QueueView:
        store, uid = (self.watches.workloads if self.watches else None), cluster["metadata"]["uid"]
        if await self._synced(store):
            return NO_KUEUE if store.missing else queue_view(store.indexed(namespace, uid), uid)
        # Not kept until Kueue has said something: its Workload appears just after the cluster.
        return await self._every(("workloads", cluster["metadata"]), lambda: self._queue_view(namespace, uid),
                                 keep=lambda queue: bool(queue.message))

    async def observe(self, ident: Identity, name: str) -> ClusterView:
        body = await self._cluster(ident.namespace, name)
        view = cluster_view(body, ident.uid, self.settings)
        if not (view.exists and view.owned):
            return view
        if view.suspended and QUEUE_NAME_LABEL in _labels(body):
            return dataclasses.replace(view, queue=await self._queue(ident.namespace, body))
        pods = await self._pods(ident.namespace, body)
        if view.ready:
            # When its hosts were ready: usage counts from then.
            return dataclasses.replace(view, hosts_ready_since=podstatus.hosts_ready_since(pods))
        return dataclasses.replace(view, pod_problem=podstatus.worst_problem(pods),
                                   hosts_ready=podstatus.hosts_ready(pods), routine_wait=podstatus.routine_wait(pods))

    async def _every(self, what: tuple[str, dict], read, keep=lambda value: True):
        """`read()` (blocking, run in a thread) at most every RECHECK_S for one version of
        a RayCluster: the pods or the Workload of a cluster that waits change slowly, and a
        change of the RayCluster itself reads again."""
        kind, meta = what
        key, version, now = (kind, meta.get("uid", "")), meta.get("resourceVersion", ""), time.monotonic()
        last = self._checks.get(key)
        if last is not None and last[0] == version and now - last[1] < RECHECK_S:
            return last[2]
        value = await self._call(read)
        if keep(value):
            self._checks[key] = (version, now, value)
        return value

    async def maintenance(self, ident: Identity, cluster: str) -> tuple[tuple[str, str], ...]:
        """(node, label value) for the nodes of the cluster's pods with maintenance
        scheduled. The pods are listed only while some node has the label at all."""
        if not self.maintenance_nodes:
            return ()
        body = await self._cluster(ident.namespace, cluster)
        pods = await self._pods(ident.namespace, body) if body is not None else []
        nodes = {(p.get("spec") or {}).get("nodeName") for p in pods}
        return tuple(sorted((n, v) for n, v in self.maintenance_nodes.items() if n in nodes))

    async def slice_health(self, ident: Identity, name: str, since, hosts: int) -> podstatus.SliceHealth:
        """The cluster's pods and their nodes, read once a job ended without success (RBAC:
        list pods, get nodes)."""
        return await self._call(self._slice_health, ident.namespace, name, since, hosts)

    def _slice_health(self, namespace: str, name: str, since, hosts: int) -> podstatus.SliceHealth:
        pods = self._cluster_pods(namespace, name)
        nodes = {}
        for node_name in sorted({(p.get("spec") or {}).get("nodeName") for p in pods} - {None, ""}):
            try:
                node = self.core.read_node(node_name, _request_timeout=self._timeout)
                nodes[node_name] = self.core.api_client.sanitize_for_serialization(node)
            except ApiException as error:
                if error.status != 404:
                    raise
                nodes[node_name] = None
        return podstatus.slice_health(pods, nodes, since, hosts)

    def _queue_view(self, namespace: str, cluster_uid: str) -> QueueView:
        workloads = self._workloads(namespace, cluster_uid)
        return NO_KUEUE if workloads is None else queue_view(workloads, cluster_uid)

    def forget(self, namespace: str, name: str, cluster_uid: str) -> None:
        """A RayCluster is gone: drop what was kept for it."""
        self._created.pop((namespace, name), None)
        self._foreign.discard((namespace, name))
        for kind in ("pods", "workloads"):
            self._checks.pop((kind, cluster_uid), None)

    def _cluster_pods(self, namespace: str, name: str) -> list[dict]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=f"{CLUSTER_LABEL}={name}",
                                             _request_timeout=self._timeout)
        return [self.core.api_client.sanitize_for_serialization(p) for p in pods.items]

    def _workloads(self, namespace: str, cluster_uid: str) -> list[dict] | None:
        """Kueue's Workloads of one RayCluster (RBAC: list workloads, nothing more); None
        when the API has no Workloads (Kueue is not installed)."""
        try:
            found = self.objects.list_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, label_selector=f"{JOB_UID_LABEL}={cluster_uid}",
                _request_timeout=self._timeout)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return found.get("items") or []

    def _get_cluster(self, namespace: str, name: str) -> dict | None:
        try:
            return self.objects.get_namespaced_custom_object(RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name,
                                                             _request_timeout=self._timeout)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def create(self, ident: Identity, manifest: dict) -> None:
        # The run's token Secret (which the RayCluster's pods need) and NetworkPolicy first.
        # Each create is fenced by the Lease just before it is made (adapters/lease.py).
        try:
            await self._call(self._fenced, f"creating {ident.namespace}/{ident.name}'s token Secret and "
                                           "NetworkPolicy", self.tokens.create_for_run, ident)
        except SigningKeyError as error:  # shown, and timed, as a refused create
            raise CreateRefused(f"the run's Ray token could not be derived: {error}") from None
        except ApiException as error:  # any answer but a success: shown and timed, not retried blind
            raise CreateRefused(f"the run's token Secret or NetworkPolicy could not be created: "
                                f"{api_answer(error)}") from None
        await self._call(self._create_cluster, ident, manifest)
        self._created[(ident.namespace, manifest["metadata"]["name"])] = time.monotonic()

    async def ray_token(self, ident: Identity) -> str | None:
        """The token of the run's own head (derived, core/raytoken.py); None with a fixed
        dashboard, whose token is TPUFT_RAY_TOKEN."""
        if self.settings.fixed_dashboard:
            return None
        return await self._call(self.tokens.token, ident)

    @staticmethod
    def _fenced(what: str, call, *args):
        lease.check_held(what)
        return call(*args)

    def _create_cluster(self, ident: Identity, manifest: dict) -> None:
        """Create the RayCluster. Every answer but a success is a CreateRefused carrying
        the API server's code and message: a webhook or a policy (400, 403, 422), the
        KubeRay CRD missing (404), a webhook that fails (500): each is shown in status and
        counted against the provisioning timeout. A 409 is a success only when the cluster
        there is this run's (its owner uid): a namesake's (a TPUFineTune of the same name
        deleted, its cluster not collected yet) is not."""
        namespace, name = ident.namespace, manifest["metadata"]["name"]
        lease.check_held(f"creating RayCluster {namespace}/{name}")
        try:
            self.objects.create_namespaced_custom_object(RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, manifest,
                                                         _request_timeout=self._timeout)
        except ApiException as error:
            if error.status != 409:
                raise CreateRefused(api_answer(error)) from None
            there = self._get_cluster(namespace, name)
            if there is None or not cluster_view(there, ident.uid, self.settings).owned:
                self._foreign.add((namespace, name))
                raise CreateRefused(f"{api_answer(error)}; it is not this TPUFineTune's (owner uid {ident.uid}): "
                                    "waiting for it to go") from None

    async def delete(self, ident: Identity, name: str, uid: str = "") -> None:
        """Delete the run's RayCluster `uid`: the one the run recorded and decided on, never
        one a fresh read finds (a newer leader's, of the same name). Without a uid (an
        older caller) the owned one a read finds."""
        await self._call(self._delete_cluster, ident, name, uid)

    def _delete_cluster(self, ident: Identity, name: str, uid: str = "") -> None:
        # Preconditions: only delete the object we own (uid checked on observe), and
        # only if it is still the same object.
        if not uid:
            body = self._get_cluster(ident.namespace, name)
            if body is None or not cluster_view(body, ident.uid, self.settings).owned:
                return
            if body["metadata"].get("deletionTimestamp"):
                return  # already being deleted: asking again changes nothing and costs a write
            uid = body["metadata"]["uid"]
        options = client.V1DeleteOptions(propagation_policy="Background", preconditions=client.V1Preconditions(uid=uid))
        lease.check_held(f"deleting RayCluster {ident.namespace}/{name}")
        try:
            self.objects.delete_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, ident.namespace, RAY_PLURAL, name, body=options,
                _request_timeout=self._timeout,
            )
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    async def write_status(self, ident: Identity, patch: dict, new: dict, resource_version: str) -> str:
        """A JSON merge patch of the status carrying the resourceVersion last read or
        written (when known): the API server refuses it (409, StatusConflict) if the object
        changed since, so a stale copy (a replica that lost its Lease) never overwrites a
        newer status. Returns the new resourceVersion."""
        body = {"status": patch}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            written = await self._call(
                self.objects.patch_namespaced_custom_object_status,
                GROUP, VERSION, ident.namespace, PLURAL, ident.name, body,
                _request_timeout=self._timeout,
            )
        except ApiException as error:
            if error.status == 409:
                raise StatusConflict(f"{ident.namespace}/{ident.name} changed since resourceVersion "
                                     f"{resource_version}") from None
            raise
        return (written.get("metadata") or {}).get("resourceVersion", "")

    async def read_status(self, ident: Identity) -> tuple[dict, str] | None:
        """(the object's status as the API server holds it now, its resourceVersion); None
        if it is gone."""
        try:
            body = await self._call(self.objects.get_namespaced_custom_object,
                                           GROUP, VERSION, ident.namespace, PLURAL, ident.name,
                                           _request_timeout=self._timeout)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return dict(body.get("status") or {}), body["metadata"].get("resourceVersion", "")

    async def read_run(self, namespace: str, name: str) -> dict | None:
        """Another TPUFineTune of the namespace (a chained run's source, spec.model.initFrom) as the
        API server holds it now; None if there is none (RBAC: get tpufinetunes)."""
        try:
            return await self._call(self.objects.get_namespaced_custom_object, GROUP, VERSION, namespace,
                                    PLURAL, name, _request_timeout=self._timeout)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def drop_finalizer(self, ident: Identity, finalizer: str) -> str:
        """`finalizer` off the run's object, and nothing else of it touched (RBAC: patch
        tpufinetunes cluster-wide, which holds in a namespace being deleted): "removed";
        "gone" (the object, or the finalizer on it); "changed" when another writer changed
        the list meanwhile."""
        return await self._call(self._drop_finalizer, ident, finalizer)

    def _drop_finalizer(self, ident: Identity, finalizer: str) -> str:
        def patch(operations: list[dict]) -> dict:
            return self.objects.patch_namespaced_custom_object(
                GROUP, VERSION, ident.namespace, PLURAL, ident.name, operations,
                _content_type="application/json-patch+json", _request_timeout=self._timeout)
        try:
            # A patch that changes nothing answers with the object: its finalizers now.
            body = patch([{"op": "test", "path": "/metadata/name", "value": ident.name}])
            operations = finalizer_removal(body["metadata"].get("finalizers") or [], finalizer)
            if not operations:
                return "gone"
            patch(operations)
        except ApiException as error:
            if error.status == 404:
                return "gone"
            if error.status == 422:  # the test failed: the list changed since it was read
                return "changed"
            raise
        return "removed"

    def record(self, ident: Identity, type_: str, reason: str, message: str) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "TPUFineTune",
            "metadata": {"name": ident.name, "namespace": ident.namespace, "uid": ident.uid},
        }
        kopf.event(body, type=type_, reason=reason, message=message)
