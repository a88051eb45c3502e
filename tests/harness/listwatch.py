"""One list-then-watch loop, as a kubelet's informers run it: list, watch from that
resourceVersion, list again when it expired (410), and keep going through API server
restarts and dropped streams until `stop` is set."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kubernetes import watch
from kubernetes.client.rest import ApiException

log = logging.getLogger("listwatch")


def list_and_watch(list_call: Callable, on_list: Callable[[list], None], on_event: Callable[[str, object], None],
                   stop: threading.Event, what: str, **selectors) -> None:
    """`on_list(items)` after each full list, `on_event(type, object)` for each watch event."""
    resource_version = None
    while not stop.is_set():
        try:
            if resource_version is None:
                listing = list_call(**selectors)
                on_list(listing.items)
                resource_version = listing.metadata.resource_version
            for event in watch.Watch().stream(list_call, resource_version=resource_version,
                                              timeout_seconds=60, **selectors):
                resource_version = event["object"].metadata.resource_version
                on_event(event["type"], event["object"])
        except ApiException as error:
            if error.status == 410:  # expired: list again
                resource_version = None
            else:
                log.warning("%s watch: %s", what, error)
                time.sleep(1)
        except Exception as error:  # the API server restarting, a dropped stream
            log.warning("%s watch: %s", what, error)
            time.sleep(1)
