"""List-then-watch caches of the objects runs look at while they wait: their RayClusters,
those clusters' pods, and Kueue's Workloads. One list and one open watch per kind, shared
by every run, so what the operator asks of the API server at rest does not grow with the
number of runs that only wait (no GET or LIST per run per tick).

Each kind is an `Informer` thread over the synchronous Kubernetes client, as client-go's
informers work: list (in pages), watch from the list's resourceVersion with bookmarks,
list again when the watch expired (410 Gone), and keep going through dropped streams and
API server restarts with a backoff. A new list replaces the store, so an object deleted
while no watch was open is dropped too: the store is complete once synced, and an object
missing from a synced store does not exist (as far as the API server had told).

Objects are kept projected to the fields the operator reads (`project_*`): thousands of
pods and clusters cost a few MB, not their full manifests. Watch lines are parsed as JSON
(no model classes). Each change calls `on_change(kind, type, object)` in the informer's
thread; the handlers pass it to the event loop to wake the run concerned.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Callable

from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from tpufinetune.core.sizing import MANAGED_BY_LABEL

log = logging.getLogger(__name__)

# The API server ends each watch after this long (a new one resumes at once); its answer
# must come within this plus the read margin, else the stream is treated as dead.
WATCH_SERVER_TIMEOUT_S = 240
WATCH_READ_MARGIN_S = 60
LIST_PAGE = 500
BACKOFF_S = (1.0, 30.0)
# An API that is not served (Kueue not installed) is listed again this often.
MISSING_API_RECHECK_S = 60.0

Key = tuple[str, str]


class Store:
    """Projected objects by (namespace, name), with an optional secondary index (e.g. the
    RayCluster a pod belongs to). Written by one informer thread, read by the event loop."""

    def __init__(self, project: Callable[[dict], dict], index: Callable[[dict], str | None] | None = None):
        self._project = project
        self._index_of = index
        self._lock = threading.Lock()
        self._items: dict[Key, dict] = {}
        self._index: dict[Key, set[Key]] = {}
        self.synced = threading.Event()
        self.missing = False  # the API answered 404: the resource is not served

    def __len__(self) -> int:
        return len(self._items)

    def get(self, namespace: str, name: str) -> dict | None:
        return self._items.get((namespace, name))

    def indexed(self, namespace: str, value: str) -> list[dict]:
        with self._lock:
            keys = sorted(self._index.get((namespace, value), ()))
            return [self._items[key] for key in keys if key in self._items]

    def replace(self, objects: list[dict]) -> list[tuple[str, dict]]:
        """A full list: returns what changed against the store, as (type, object), deletions
        included (an object gone while no watch was open)."""
        fresh = {}
        for obj in objects:
            item = self._project(obj)
            fresh[_key(item)] = item
        with self._lock:
            changes = [("DELETED", item) for key, item in self._items.items() if key not in fresh]
            changes += [("ADDED" if key not in self._items else "MODIFIED", item) for key, item in fresh.items()
                        if self._items.get(key) != item]
            self._items = fresh
            self._index = {}
            for key, item in fresh.items():
                self._add_index(key, item)
        return changes

    def apply(self, type_: str, obj: dict) -> dict:
        """One watch event; returns the projected object."""
        item = self._project(obj)
        key = _key(item)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._drop_index(key, old)
            if type_ != "DELETED":
                self._items[key] = item
                self._add_index(key, item)
        return item

    def _add_index(self, key: Key, item: dict) -> None:
        value = self._index_of(item) if self._index_of else None
        if value:
            self._index.setdefault((key[0], value), set()).add(key)

    def _drop_index(self, key: Key, item: dict) -> None:
        value = self._index_of(item) if self._index_of else None
        if value:
            keys = self._index.get((key[0], value))
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._index[(key[0], value)]


def _key(item: dict) -> Key:
    meta = item.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class Informer(threading.Thread):
    """Keeps one Store current. `list_call` is a Kubernetes client list function with its
    positional arguments bound (it takes label_selector, watch, resource_version, ...)."""

    def __init__(self, kind: str, list_call: Callable, store: Store, on_change: Callable[[str, str, dict], None],
                 timeout: float, label_selector: str = ""):
        super().__init__(name=f"informer-{kind}", daemon=True)
        self.kind = kind
        self.list_call = list_call
        self.store = store
        self.on_change = on_change
        self.timeout = timeout
        self.label_selector = label_selector
        self.stopping = threading.Event()
        self._response = None
        self.lists = 0  # how many full lists (the first, and each after a 410 or an error)

    def stop(self) -> None:
        self.stopping.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown()  # unblocks the read of the open watch in the informer's thread
            except Exception:  # noqa: BLE001 - shutting a dead stream may fail; we are leaving anyway
                pass

    def run(self) -> None:
        least, most = BACKOFF_S
        delay = least
        version = None
        while not self.stopping.is_set():
            try:
                if version is None:
                    version = self._list()
                version = self._watch(version)
                delay = least
            except Gone:
                version = None
            except ApiException as error:
                version = None
                if error.status == 404:
                    self._missing()
                    self.stopping.wait(MISSING_API_RECHECK_S)
                    continue
                log.warning("%s: list or watch failed (%s %s); again in %gs", self.kind, error.status,
                            error.reason, delay)
                self.stopping.wait(delay)
                delay = min(delay * 2, most)
            except Exception as error:  # noqa: BLE001 - a dropped stream, an unreachable API server
                if self.stopping.is_set():
                    return
                log.warning("%s: watch interrupted (%s); again in %gs", self.kind, error, delay)
                self.stopping.wait(delay)
                delay = min(delay * 2, most)
                # The watch resumes where it was; a stale version answers 410 and lists.

    def _missing(self) -> None:
        if not self.store.missing:
            log.info("%s: the API server does not serve it; looking again every %gs", self.kind,
                     MISSING_API_RECHECK_S)
        self.store.missing = True
        for type_, item in self.store.replace([]):
            self.on_change(self.kind, type_, item)
        self.store.synced.set()

    def _list(self) -> str:
        items, token = [], None
        while True:
            extra = {"_continue": token} if token else {}
            response = self.list_call(label_selector=self.label_selector, limit=LIST_PAGE, _preload_content=False,
                                      _request_timeout=(self.timeout, self.timeout), **extra)
            page = json.loads(response.data)
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                break
        self.lists += 1
        self.store.missing = False
        for type_, item in self.store.replace(items):
            self.on_change(self.kind, type_, item)
        self.store.synced.set()
        return (page.get("metadata") or {}).get("resourceVersion", "")

    def _watch(self, version: str) -> str:
        response = self.list_call(label_selector=self.label_selector, watch=True, resource_version=version,
                                  allow_watch_bookmarks=True, timeout_seconds=WATCH_SERVER_TIMEOUT_S,
                                  _preload_content=False,
                                  _request_timeout=(self.timeout, WATCH_SERVER_TIMEOUT_S + WATCH_READ_MARGIN_S))
        self._response = response
        try:
            for line in iter_resp_lines(response):
                if self.stopping.is_set():
                    break
                event = json.loads(line)
                type_, obj = event.get("type"), event.get("object") or {}
                if type_ == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(obj.get("message", ""))
                    raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if type_ == "BOOKMARK":
                    continue
                self.on_change(self.kind, type_, self.store.apply(type_, obj))
        finally:
            self._response = None
            response.release_conn()
        return version


def _pick(source: dict | None, keys: tuple[str, ...]) -> dict:
    source = source or {}
    return {k: source[k] for k in keys if k in source}


META_KEYS = ("name", "namespace", "uid", "resourceVersion", "labels", "creationTimestamp", "deletionTimestamp")


def project_raycluster(obj: dict) -> dict:
    """What cluster_view reads: identity, owner, labels, suspend, KubeRay's status; and
    whether its pods carry the label the pod informer selects on (a cluster an older
    version created has unlabelled pods: those are listed, as before)."""
    meta = obj.get("metadata") or {}
    head = (((obj.get("spec") or {}).get("headGroupSpec") or {}).get("template") or {}).get("metadata") or {}
    return {
        "metadata": {**_pick(meta, META_KEYS),
                     "ownerReferences": [_pick(r, ("uid", "kind", "name", "controller"))
                                         for r in meta.get("ownerReferences") or []]},
        "spec": _pick(obj.get("spec"), ("suspend",)),
        "status": obj.get("status") or {},
        "podsLabelled": bool((head.get("labels") or {}).get(MANAGED_BY_LABEL)),
    }


def project_pod(obj: dict) -> dict:
    """What core/podstatus reads of a pod."""
    status = obj.get("status") or {}
    containers = ("name", "state", "lastState", "restartCount", "ready")
    return {
        "metadata": _pick(obj.get("metadata"), META_KEYS),
        "spec": _pick(obj.get("spec"), ("nodeName",)),
        "status": {**_pick(status, ("phase", "reason", "message", "startTime", "conditions")),
                   "containerStatuses": [_pick(c, containers) for c in status.get("containerStatuses") or []],
                   "initContainerStatuses": [_pick(c, containers) for c in status.get("initContainerStatuses") or []]},
    }


def project_workload(obj: dict) -> dict:
    """What core's queue_view reads of Kueue's Workload: its owner and conditions."""
    meta = obj.get("metadata") or {}
    return {
        "metadata": {**_pick(meta, META_KEYS),
                     "ownerReferences": [_pick(r, ("uid", "kind", "name")) for r in meta.get("ownerReferences") or []]},
        "status": {"conditions": (obj.get("status") or {}).get("conditions") or []},
    }
