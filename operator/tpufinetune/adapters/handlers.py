"""kopf handlers: small, and only wiring. The work is in driver.Run and phases.transition.

- one daemon per TPUFineTune drives its run (re-attaches after an operator restart);
- a change of a run's RayCluster, its pods or its Kueue Workload (the watches of
  adapters/informer.py, started here), an edit of its spec or its deletion wakes the run
  at once instead of at its next poll;
- deletion stops the job and deletes the RayCluster before the finalizer is released;
- a liveness probe fails /healthz once the operator as a whole makes no progress: runs'
  status writes failing for its own reasons (no answer, 5xx, its credentials) for longer
  than TPUFT_STALL_TIMEOUT with no status read or written since (core/progress.py), so
  Kubernetes restarts it. One object the API server refuses is that run's trouble: an
  Event and a gauge, never a restart of every run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import kopf
from kubernetes import client, config

from tpufinetune.adapters import memory, metrics
from tpufinetune.core import phases
from tpufinetune.core.api import GROUP, PLURAL, VERSION
from tpufinetune.core.progress import ProgressTracker
from tpufinetune.core.errors import StatusConflict
from tpufinetune.driver import Run
from tpufinetune.runray import _one_line
from tpufinetune.runstatus import conflict_backoff
from tpufinetune.adapters.lease import LeaseLost
from tpufinetune.adapters.kube import MAINTENANCE_LABEL, RAY_PLURAL, KubeBackend, Watches
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.settings import Settings

log = logging.getLogger(__name__)
FINALIZER = f"{GROUP}/release"
RUNS: dict[tuple[str, str], Run] = {}
# (namespace, source) -> the runs whose spec.model.initFrom names that source, from their own
# events (resource_seen): a source's event wakes only them, not a look over every run.
CHAINED: dict[tuple[str, str], set[tuple[str, str]]] = {}
CHAIN_OF: dict[tuple[str, str], tuple[str, str]] = {}  # the other way round
# Watched namespaces whose deletion is under way, from the namespace watch (namespace_deleted).
ENDING_NAMESPACES: set[str] = set()
RELEASE_WAIT_S = 60


# The default executor serves only what is left after the Ray and Kubernetes pools: the
# event loop's DNS lookups (aiohttp: kopf's API calls, the log streams).
DEFAULT_THREADS = 8
# kopf runs synchronous handlers in its executor; every handler here is async.
KOPF_THREADS = 2


def _load_kube_config(connections: int | None = None) -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    configuration = client.Configuration.get_default_copy()
    if connections:  # one kept connection per Kubernetes thread (the client's default: 5 per CPU)
        configuration.connection_pool_maxsize = connections
    return client.ApiClient(configuration)


# kopf's requests to the API server (its finalizer patches, its Events) share at most this
# many kept connections; each watch stream holds one more for its whole life. kopf's own
# session has no limit: a burst of new runs opened a TLS connection per request in flight
# (244 for a burst of 1,000 runs, each with asyncio's 256 KiB read buffer: 32 MB) and kept
# them alive.
KOPF_REQUEST_CONNECTIONS = 16
# kopf's watch streams beyond one per watched namespace: the nodes, kopf's own peering and
# namespace scans, with room to spare (a stream waiting for a connection would never start).
KOPF_OTHER_STREAMS = 4


def kopf_connection_limit(namespaces: int) -> int:
    """Connections for kopf's session: its requests, plus one per watch stream (the
    TPUFineTunes of each namespace, or of all of them in one stream)."""
    return KOPF_REQUEST_CONNECTIONS + max(1, namespaces) + KOPF_OTHER_STREAMS


@kopf.on.login()
async def login(memo: kopf.Memo, **kwargs) -> kopf.AiohttpSession | None:
    """kopf's own login (the in-cluster ServiceAccount, else the kubeconfig), with a session
    whose connections are bounded (kopf_connection_limit); kopf closes it on a re-login."""
    info = kopf.login_via_client(memo=memo, **kwargs)
    if info is None:
        return None
    limit = kopf_connection_limit(int(getattr(memo, "watched_namespaces", 0) or 0))
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(), proxy=info.proxy_url, trust_env=info.trust_env)
    return kopf.AiohttpSession(aiohttp_session=session, server=info.server, priority=info.priority,
                               default_namespace=info.default_namespace, expiration=info.expiration)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    memo.settings = Settings.from_env()
    api = _load_kube_config(memo.settings.kube_threads)
    loop = asyncio.get_running_loop()
    memo.watches = Watches(api, memo.settings,
                           lambda kind, type_, item: loop.call_soon_threadsafe(_changed, memo, kind, type_, item))
    memo.backend = KubeBackend(api, memo.settings, memo.watches)
    memo.watches.start()
    memo.trimmer = asyncio.create_task(memory.trim_forever(), name="memory-trim")
    memo.jobs = RayJobs(headers=memo.settings.ray_headers(), timeout=memo.settings.ray_timeout,
                        threads=memo.settings.ray_threads)
    memo.progress = ProgressTracker()
    metrics.STATUS_WRITES.tracker = memo.progress
    metrics.per_run(memo.settings.run_metrics)
    settings.persistence.finalizer = FINALIZER
    # kopf's bookkeeping goes into status, never into metadata.annotations: the object
    # users and Argo CD compare stays exactly what they applied.
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(field="status.kopf.lastHandledConfiguration")
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # kopf's own short calls (its patches, Events) are bounded as ours are.
    settings.networking.request_timeout = memo.settings.kube_timeout
    settings.networking.connect_timeout = memo.settings.kube_timeout
    # Ray and Kubernetes calls have a pool each (RayJobs, KubeBackend); these serve the rest.
    settings.execution.executor = ThreadPoolExecutor(max_workers=KOPF_THREADS, thread_name_prefix="kopf")
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=DEFAULT_THREADS, thread_name_prefix="asyncio"))


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10)
async def follow_run(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_) -> None:
    run = Run(body, memo.backend, memo.jobs, memo.settings, memo.progress)  # the live view: sees edits
    key = (run.ident.namespace, run.ident.name)
    RUNS[key] = run
    try:
        await run.settle(lambda: kopf_wrote_its_own(body), stopped)
        await run.run(stopped)
    finally:
        if RUNS.get(key) is run:
            del RUNS[key]
            memo.progress.forget(run.progress_key)
        await run.close()


@kopf.on.cleanup()
async def stop_watches(memo: kopf.Memo, **_) -> None:
    watches = getattr(memo, "watches", None)
    if watches is not None:
        watches.stop()
    trimmer = getattr(memo, "trimmer", None)
    if trimmer is not None:
        trimmer.cancel()


def _changed(memo: kopf.Memo, kind: str, type_: str, item: dict) -> None:
    """A RayCluster, one of its pods or its Workload changed (adapters/informer.py, in the
    event loop): the owning run looks at once instead of at its next poll."""
    meta = item.get("metadata") or {}
    if kind == RAY_PLURAL and type_ == "DELETED":
        memo.backend.forget(meta.get("namespace", ""), meta.get("name", ""), meta.get("uid", ""))
    run = RUNS.get((meta.get("namespace"), memo.watches.owner(kind, item)))
    if run is not None:
        run.wake.set()


@kopf.on.event("", "v1", "nodes")
async def node_maintenance(type: str, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    """GKE labels a node before its maintenance: the runs are woken to look at their pods'
    nodes (RBAC: nodes list/watch). Every node is watched, not only labelled ones, so a
    label that goes away is seen too."""
    name = body.get("metadata", {}).get("name", "")
    value = (body.get("metadata", {}).get("labels") or {}).get(MAINTENANCE_LABEL)
    if type == "DELETED" or value is None:
        memo.backend.maintenance_nodes.pop(name, None)
        return
    if memo.backend.maintenance_nodes.get(name) != value:
        memo.backend.maintenance_nodes[name] = value
        for run in list(RUNS.values()):
            run.wake.set()


def drop_managed_fields(body) -> None:
    """kopf keeps each live object's body, as its watch delivered it, for the object's
    daemon (the Run's live view) until the next event replaces it. Its managedFields (every
    writer's field list: about 11 KB decoded a run, a third of what a waiting run holds)
    are read by nothing here, so they go, in place: kopf's view hands out its own dicts.
    kopf calls the event handlers right after it puts an event's body in place, and before
    it spawns a new object's daemon, so the kept body holds them only for that moment."""
    meta = body.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)


def drop_taken_status(body) -> None:
    """Once a run's daemon holds its own copy of the status (Run.status_taken), the kept
    body's status is read by nothing here but kopf's own status.kopf: the rest (the applied
    spec, the plan, the attempts, the conditions: about a third of a waiting run's body)
    goes, in place, until the next event brings it back. metrics.seen has read it first."""
    status = body.get("status")
    if isinstance(status, dict):
        kept = status.get("kopf")
        status.clear()
        if kept is not None:
            status["kopf"] = kept


@kopf.on.event("", "v1", "namespaces")
async def namespace_deleted(type: str, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    """A watched namespace being deleted: the namespace controller deletes the operator's
    RoleBinding there in its first pass, and kopf stops watching a namespace whose deletion
    is under way, so on.delete may never run for its runs and their finalizers would hold the
    namespace in Terminating for ever. Each run's finalizer goes here (RBAC: patch
    tpufinetunes cluster-wide); the namespace controller deletes their RayClusters."""
    meta = body.get("metadata", {})
    namespace = meta.get("name", "")
    if type == "DELETED" or not meta.get("deletionTimestamp"):
        ENDING_NAMESPACES.discard(namespace)
        return
    ENDING_NAMESPACES.add(namespace)
    for name in metrics.names_in(namespace):
        if (run := RUNS.get((namespace, name))) is not None:
            run.end_with_namespace()
        ident = phases.Identity(name=name, namespace=namespace, uid="")
        try:
            dropped = await memo.backend.drop_finalizer(ident, FINALIZER)
        except Exception as error:  # noqa: BLE001 - the namespace's next event tries again
            log.warning("%s/%s: its namespace is being deleted; removing the finalizer failed: %s",
                        namespace, name, error)
            continue
        if dropped != "changed":  # the namespace's next event tries a changed one again
            metrics.forget(namespace, name)
        if dropped == "removed":
            log.info("%s/%s: its namespace is being deleted; finalizer removed (the namespace controller "
                     "deletes its RayCluster)", namespace, name)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def resource_seen(type: str, body: kopf.Body, **_) -> None:
    """Every change to a TPUFineTune, from kopf's watch:
    - the tpufinetune_resources gauge and the per-run series follow it, deletions included
      (a deleted run's series go);
    - any change wakes the runs that wait for this one to succeed (spec.model.initFrom);
    - an edit (a new generation: spec.suspend, a deadline) or a deletion wakes its run, which
      acts now instead of after its sleep (a waiting run sleeps up to a minute); so does any
      change while a new run waits for kopf's first writes (Run.settle).
    One handler for both: kopf runs it for every event anyway, and a run compares the
    generation itself (kopf's on.field would add a handler run, and its bookkeeping, to
    every creation).
    It also drops the body's managedFields (drop_managed_fields) and, once the run holds its
    own copy, the status kopf does not need (drop_taken_status)."""
    drop_managed_fields(body)
    meta = body.get("metadata", {})
    key = (meta.get("namespace"), meta.get("name"))
    note_chain(key, None if type == "DELETED" else body.get("spec"))
    for chained in CHAINED.get(key, ()):
        waiting = RUNS.get(chained)
        if waiting is not None and waiting.waits_on == key[1]:
            waiting.wake.set()  # a run chained to this one (spec.model.initFrom) looks at it now
    if type == "DELETED":
        metrics.forget(*key, meta.get("uid", ""))
        return
    metrics.seen(*key, dict(body.get("status") or {}))
    run = RUNS.get(key)
    if run is not None and (meta.get("generation") != run.generation or meta.get("deletionTimestamp")
                            or run.settling):
        run.wake.set()
    if run is not None and run.status_taken:
        drop_taken_status(body)


def note_chain(key: tuple[str, str], spec: dict | None) -> None:
    """Keep CHAINED up to date with the run `key`'s spec (None: deleted)."""
    source = (((spec or {}).get("model") or {}).get("initFrom") or {}).get("run")
    chain = (key[0], source) if source else None
    before = CHAIN_OF.get(key)
    if before == chain:
        return
    if before is not None:
        CHAINED[before].discard(key)
        if not CHAINED[before]:
            del CHAINED[before]
        del CHAIN_OF[key]
    if chain is not None:
        CHAINED.setdefault(chain, set()).add(key)
        CHAIN_OF[key] = chain


def kopf_wrote_its_own(body) -> bool:
    """kopf's first writes to a new run are in: its finalizer, and the configuration it
    keeps in status.kopf (settings.persistence, above)."""
    kopf_status = (body.get("status") or {}).get("kopf") or {}
    return FINALIZER in (body.get("metadata", {}).get("finalizers") or []) and \
        "lastHandledConfiguration" in kopf_status


# kopf retries a failed handler after a minute by default: longer than a delete may take.
RELEASE_RETRY_S = 5


@kopf.on.delete(GROUP, VERSION, PLURAL, backoff=RELEASE_RETRY_S)
async def release(body: kopf.Body, memo: kopf.Memo, **_) -> None:
    """Delete the RayCluster (asking its job to stop first, best effort); the finalizer
    goes once the RayCluster is gone. Ray is never waited on, and a failed call (a read the
    API server did not answer in time) is tried again here, within seconds."""
    key = (body["metadata"].get("namespace"), body["metadata"]["name"])
    if key[0] in ENDING_NAMESPACES:
        # The namespace controller deletes the RayCluster and everything else of the run,
        # and the operator's RoleBinding there is already gone: the finalizer goes now
        # (deploy/base/clusterrole.yaml: patch tpufinetunes cluster-wide), or the namespace
        # would stay Terminating.
        log.info("%s/%s: its namespace is being deleted; the namespace controller releases its RayCluster", *key)
        if key in RUNS:
            memo.progress.forget(RUNS[key].progress_key)
        return
    run = RUNS.get(key) or Run(dict(body), memo.backend, memo.jobs, memo.settings, memo.progress)
    # Wait here for the garbage collector (seconds, normally): kopf would post a retry
    # as an Error event, and a normal delete is not an error.
    # A deleting step never waits on its status write (driver.Run._step): a refused or
    # conflicting write neither holds the RayCluster nor keeps the finalizer.
    deadline = asyncio.get_running_loop().time() + RELEASE_WAIT_S
    conflicts = failures = 0
    while True:
        try:
            decision = await run.step(deleting=True)
        except StatusConflict:
            # Another writer came first (re-read, then step again): a conflict is not a
            # failure worth an Error event, and a retry waits a little longer each time.
            if asyncio.get_running_loop().time() > deadline:
                raise
            conflicts += 1
            await asyncio.sleep(conflict_backoff(conflicts, memo.settings.poll_interval))
            continue
        except LeaseLost:
            raise  # this operator may no longer act: the next leader releases it
        except Exception as error:
            if asyncio.get_running_loop().time() > deadline:
                raise
            failures += 1
            log.warning("%s/%s: releasing its RayCluster: %s; trying again", *key, _one_line(error))
            await asyncio.sleep(min(RELEASE_RETRY_S, 0.5 * 2 ** (failures - 1)))
            continue
        if not any(isinstance(a, phases.DeleteCluster) for a in decision.actions):
            memo.progress.forget(run.progress_key)
            return
        if asyncio.get_running_loop().time() > deadline:
            raise kopf.TemporaryError("waiting for the RayCluster to go", delay=5)
        await asyncio.sleep(1)


@kopf.on.probe(id="statusWrites", errors=kopf.ErrorsMode.PERMANENT)
async def status_writes(memo: kopf.Memo, **_) -> int:
    """/healthz fails (kopf answers 500) once the operator as a whole makes no progress:
    status writes failing for the operator's reasons for longer than TPUFT_STALL_TIMEOUT,
    and no run's status read or written within it; a restart (the Deployment's
    livenessProbe) gives it a fresh process and connection. A run the API server refuses
    for its own reasons never fails it. Healthy, it reports how many runs have a failing
    status write."""
    stalled = memo.progress.stalled(time.monotonic(), memo.settings.stall_timeout)
    if stalled:
        raise kopf.PermanentError("runs make no progress: " + "; ".join(stalled))
    return len(memo.progress.failing)
