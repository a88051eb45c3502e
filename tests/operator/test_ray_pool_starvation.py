"""Ray calls cannot starve Kubernetes calls: ten runs whose Ray heads black-hole every
request (real listening sockets that accept and never answer) hold every thread of the
operator's Ray pool, and a run applied meanwhile still gets its RayCluster and reaches
Provisioning at once, through Kubernetes calls only.

The operator runs as users run it (`python -m tpufinetune.cli operator`) against the real
kube-apiserver with KubeRay's RayCluster CRD (no KubeRay: the ten RayClusters are marked
ready by hand, as KubeRay would, and their runs' status says Running on those heads, as
after an operator restart). TPUFT_RAY_THREADS=4, TPUFT_RAY_TIMEOUT=30: each call to a
black hole holds a Ray thread for 30 s, and ten runs keep more calls waiting than the pool
has threads.

Checked to fail: with one pool of 4 threads shared by Ray and Kubernetes calls (as the
operator had one shared pool before), the new run was not Provisioning within the bound
(its status write and creates queued behind the 30 s Ray calls).

About 7 s on a running control plane (the operator's start, then seconds).
"""

from __future__ import annotations

import selectors
import socket
import threading
import time

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from harness.operator_process import OperatorProcess
from harness.timing import within
from harness.waiting import wait_for
from tpufinetune.core.api import GROUP, PLURAL, VERSION, parse_spec
from tpufinetune.core.sizing import render_raycluster

from run_helpers import V6E_SPEC, tpufinetune

RAY_THREADS = 4
STUCK = 10
PROVISIONING_S = 10.0  # apply -> Provisioning with its RayCluster; the product's figure is well under 1 s

pytestmark = pytest.mark.cluster


class BlackHoles:
    """`count` listening sockets that accept every connection and never answer. `open` is
    how many connections are open at once (closed ones are counted out before new ones
    are counted in), `most` the largest `open` seen."""

    def __init__(self, count: int):
        self.listeners = []
        self.selector = selectors.DefaultSelector()
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            sock.setblocking(False)
            self.selector.register(sock, selectors.EVENT_READ, "listen")
            self.listeners.append(sock)
        self.urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in self.listeners]
        self.open = self.most = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            events = self.selector.select(timeout=0.2)
            for key, _ in sorted(events, key=lambda e: e[0].data == "listen"):  # closes first
                if key.data == "listen":
                    try:
                        conn, _ = key.fileobj.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(False)
                    self.selector.register(conn, selectors.EVENT_READ, "conn")
                    self.open += 1
                    self.most = max(self.most, self.open)
                elif not self._read(key.fileobj):  # the caller gave up (its timeout): closed
                    self.selector.unregister(key.fileobj)
                    key.fileobj.close()
                    self.open -= 1

    @staticmethod
    def _read(conn: socket.socket) -> bytes:
        try:
            return conn.recv(65536)
        except OSError:  # reset: closed as well
            return b""

    def close(self) -> None:
        """Every held connection closed: a call still waiting on one fails at once."""
        self._stop = True
        self._thread.join()
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()


def running_on(objects: client.CustomObjectsApi, namespace: str, name: str, url: str) -> None:
    """A TPUFineTune Running on the head at `url`, with its RayCluster ready (what KubeRay
    would say), as an operator restarting finds a run."""
    body = objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, tpufinetune(name))
    uid = body["metadata"]["uid"]
    objects.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": {
        "phase": "Running", "attempt": 1, "rayClusterName": f"tft-{name}", "jobId": f"tft-{uid}-1",
        "dashboardURL": url, "message": "training"}})
    objects.create_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters",
                                            render_raycluster(name, namespace, uid, parse_spec(V6E_SPEC)))
    objects.patch_namespaced_custom_object_status("ray.io", "v1", namespace, "rayclusters", f"tft-{name}",
                                                  {"status": {"state": "ready"}})


def test_black_holed_ray_heads_hold_the_ray_pool_and_a_new_run_still_provisions(
        control_plane, kuberay_crd, k8s_api, namespace, tmp_path):
    objects = client.CustomObjectsApi(k8s_api)
    holes = BlackHoles(STUCK)
    for i, url in enumerate(holes.urls):
        running_on(objects, namespace, f"stuck-{i}", url)
    env = control_plane.env()
    env.update(TPUFT_NAMESPACE=namespace, TPUFT_OPERATOR_NAMESPACE=namespace, TPUFT_LEADER_ELECTION="false",
               TPUFT_POLL_INTERVAL="1", TPUFT_RAY_TIMEOUT="30", TPUFT_RAY_THREADS=str(RAY_THREADS))
    operator = OperatorProcess(env, tmp_path / "operator.log")
    operator.start()
    try:
        wait_for(lambda: holes.open == RAY_THREADS, 60, "the black holes to hold every Ray thread",
                 interval=0.1, details=operator.log_tail)

        applied = time.monotonic()
        control_plane.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(tpufinetune("fresh")))

        def provisioning() -> bool:
            status = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fresh").get("status") or {}
            if status.get("phase") != "Provisioning":
                return False
            try:  # the status is written first, then the RayCluster created
                objects.get_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", "tft-fresh")
            except ApiException as error:
                if error.status == 404:
                    return False
                raise
            return True

        wait_for(provisioning, within(PROVISIONING_S), "the new run to reach Provisioning with its RayCluster "
                 "while the Ray pool is held", interval=0.1, details=operator.log_tail)
        took = time.monotonic() - applied
        # The Ray pool was held all along, and never exceeded.
        assert (holes.open, holes.most) == (RAY_THREADS, RAY_THREADS), operator.log_tail()
        phases = [objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, f"stuck-{i}")["status"]["phase"]
                  for i in range(STUCK)]
        # Waiting on Ray, within TPUFT_RAY_UNREACHABLE_TIMEOUT.
        assert phases == ["Running"] * STUCK, operator.log_tail()
        print(f"apply -> Provisioning with {STUCK} black-holed heads holding the Ray pool: {took:.1f} s")
    finally:
        holes.close()
        operator.stop()
