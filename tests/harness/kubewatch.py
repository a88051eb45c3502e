"""The objects of one kind in one namespace as the API server's watch reports them (the
kubernetes client's watch, not a poll): after every event, measures over the objects that
exist at that moment, and the largest value each took. An object's creation, each change
and its deletion are each one event, so an overlap or a change however short is seen; a
poll every half second could miss it."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from kubernetes import client, config, watch


class KubeWatch:
    """Use as a context manager; `most[name]` holds the largest `measures[name](objects)`
    seen, `events` how many changes were seen. Pods by default; `resource=(group, version,
    plural)` for a custom resource. A broken watch (an error event, a resourceVersion that
    expired: a gap in the history) is recorded in `error`, never skipped over."""

    def __init__(self, kubeconfig: Path, namespace: str, resource: tuple[str, str, str] | None = None,
                 **measures: Callable[[list[dict]], int]):
        self.namespace = namespace
        self.resource = resource
        self.measures = measures
        self.most = {name: 0 for name in measures}
        self.events = 0
        self.error: str | None = None
        self._client = config.new_client_from_config(config_file=str(kubeconfig))
        self._objects: dict[str, dict] = {}
        self._stop = threading.Event()
        self._listed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kubewatch-{namespace}", daemon=True)

    def _seen(self) -> None:
        objects = list(self._objects.values())
        for name, measure in self.measures.items():
            self.most[name] = max(self.most[name], measure(objects))

    def _lister(self):
        """The list call the watch streams, with its leading arguments."""
        if self.resource is None:
            return client.CoreV1Api(self._client).list_namespaced_pod, (self.namespace,)
        group, version, plural = self.resource
        return client.CustomObjectsApi(self._client).list_namespaced_custom_object, (group, version, self.namespace, plural)

    def _run(self) -> None:
        try:
            lister, args = self._lister()
            listing = self._client.sanitize_for_serialization(lister(*args))
            for body in listing["items"]:
                self._objects[body["metadata"]["uid"]] = body
            self._seen()
            version = listing["metadata"]["resourceVersion"]
            self._listed.set()
            while not self._stop.is_set():
                # Short server-side timeouts so that a stop is noticed; the resourceVersion
                # carries over, so no event falls between two streams.
                for event in watch.Watch().stream(lister, *args, resource_version=version, timeout_seconds=2,
                                                  allow_watch_bookmarks=True):
                    body = event["raw_object"]
                    if event["type"] == "ERROR":
                        raise RuntimeError(f"the watch broke: {body}")
                    version = body["metadata"]["resourceVersion"]
                    if event["type"] == "BOOKMARK":
                        continue
                    if event["type"] == "DELETED":
                        self._objects.pop(body["metadata"]["uid"], None)
                    else:
                        self._objects[body["metadata"]["uid"]] = body
                    self.events += 1
                    self._seen()
        except Exception as error:  # reported by __exit__: the watch must not go quiet
            self.error = f"{type(error).__name__}: {error}"
            self._listed.set()

    def __enter__(self) -> "KubeWatch":
        self._thread.start()
        if not self._listed.wait(30):
            raise AssertionError(f"the watch of {self.namespace} did not list within 30 s")
        if self.error:
            raise AssertionError(f"the watch of {self.namespace} failed: {self.error}")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        if self.error and exc[0] is None:
            raise AssertionError(f"the watch of {self.namespace} failed: {self.error}")
