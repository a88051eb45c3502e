"""The pods of one namespace as the API server's watch reports them (the kubernetes
client's watch, not a poll): after every event, measures over the pods that exist at that
moment, and the largest value each took. A pod's creation and its deletion are each one
event, so an overlap however short is seen; a poll every half second could miss it."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from kubernetes import client, config, watch


class PodWatch:
    """Use as a context manager; `most[name]` holds the largest `measures[name](pods)`
    seen, `events` how many changes were seen. A broken watch (an error event, a resourceVersion that
    expired: a gap in the history) is recorded in `error`, never skipped over."""

    def __init__(self, kubeconfig: Path, namespace: str, **measures: Callable[[list[dict]], int]):
        self.namespace = namespace
        self.measures = measures
        self.most = {name: 0 for name in measures}
        self.events = 0
        self.error: str | None = None
        self._api = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
        self._pods: dict[str, dict] = {}
        self._stop = threading.Event()
        self._listed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"podwatch-{namespace}", daemon=True)

    def _seen(self) -> None:
        pods = list(self._pods.values())
        for name, measure in self.measures.items():
            self.most[name] = max(self.most[name], measure(pods))

    def _run(self) -> None:
        try:
            listing = self._api.list_namespaced_pod(self.namespace)
            for pod in listing.items:
                body = self._api.api_client.sanitize_for_serialization(pod)
                self._pods[body["metadata"]["uid"]] = body
            self._seen()
            version = listing.metadata.resource_version
            self._listed.set()
            while not self._stop.is_set():
                # Short server-side timeouts so that a stop is noticed; the resourceVersion
                # carries over, so no event falls between two streams.
                for event in watch.Watch().stream(self._api.list_namespaced_pod, self.namespace,
                                                  resource_version=version, timeout_seconds=2,
                                                  allow_watch_bookmarks=True):
                    body = event["raw_object"]
                    if event["type"] == "ERROR":
                        raise RuntimeError(f"the pod watch broke: {body}")
                    version = body["metadata"]["resourceVersion"]
                    if event["type"] == "BOOKMARK":
                        continue
                    if event["type"] == "DELETED":
                        self._pods.pop(body["metadata"]["uid"], None)
                    else:
                        self._pods[body["metadata"]["uid"]] = body
                    self.events += 1
                    self._seen()
        except Exception as error:  # reported by __exit__: the watch must not go quiet
            self.error = f"{type(error).__name__}: {error}"
            self._listed.set()

    def __enter__(self) -> "PodWatch":
        self._thread.start()
        if not self._listed.wait(30):
            raise AssertionError(f"the pod watch of {self.namespace} did not list its pods within 30 s")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        if self.error and exc[0] is None:
            raise AssertionError(f"the pod watch of {self.namespace} failed: {self.error}")
