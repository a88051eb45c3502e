"""Node life on the test ground: what a kubelet does for its node's health, and the node
failures GKE has, run inside the node agent (nodeagent.py) for every simulated node.

- Heartbeats, as a kubelet sends them: each node's Lease in `kube-node-lease` renewed every
  RENEW_SECONDS (owned by its Node, so it goes with it), and its Ready condition refreshed
  every STATUS_SECONDS (at once when it is not True). The real node-lifecycle controller
  reads them: a node whose heartbeats stop goes NotReady, gets the `unreachable` taints and
  its pods are evicted once their tolerations run out (CONTROLLER_FLAGS, APISERVER_FLAGS).
- Nodes come from a watch: a node deleted, recreated or relabelled is seen within moments,
  never cached for good.
- Failures the ground asks for (`Ground.kill_node`, `Ground.preempt_node`) arrive as the
  annotation FAULT_ANNOTATION on the Node, so they travel through the API like everything
  else:
  - `killed`: the VM stops dead. Every process of its pods gets SIGKILL at once and the
    node sends nothing more (no heartbeats, no pod status): the node-lifecycle controller
    takes over. The Node stays registered until someone deletes it (GKE does for a VM that is
    gone; `Ground.delete_node`).
  - `preempted`: a Spot VM's preemption. GKE gives the VM PREEMPTION_NOTICE_SECONDS; the
    kubelet's graceful node shutdown reports the node NotReady ("node is shutting down"),
    sends each pod's main process SIGTERM, SIGKILLs what is left after its share
    (POD_SHUTDOWN_SECONDS, or the pod's own shorter grace), and marks the pods Failed with
    reason Terminated. When the notice is over the VM is off and, as GKE's cloud controller
    does for a VM that is gone, the Node is deleted: the pod garbage collector then removes
    the pods.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from kubernetes import client
from kubernetes.client.rest import ApiException

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from listwatch import list_and_watch  # noqa: E402
from nodepools import SIMULATED_LABEL  # noqa: E402

log = logging.getLogger("nodelife")

FAULT_ANNOTATION = "ground.tpufinetune.dev/fault"
KILLED, PREEMPTED = "killed", "preempted"
LEASE_NAMESPACE = "kube-node-lease"

# ---- timings -------------------------------------------------------------------------------
# GKE keeps the upstream defaults: a kubelet renews a 40 s Lease every 10 s, the controller
# waits 50 s (node-monitor-grace-period) before a silent node is NotReady and pods tolerate
# NotReady/unreachable for 300 s. The ground keeps the same proportions at a scale a test
# can wait for: a failed node's pods are evicted about 30 s after its last heartbeat.
LEASE_SECONDS = 20
RENEW_SECONDS = 5  # a quarter of the lease, as a kubelet does
STATUS_SECONDS = 30  # a kubelet reports an unchanged status every 5 min; often enough here
NODE_MONITOR_GRACE_SECONDS = 20
NODE_MONITOR_PERIOD_SECONDS = 2
TOLERATION_SECONDS = 10
# GKE's Spot preemption: the VM stops 30 s after the notice; non-system pods get the first
# 15 s of it (https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms).
PREEMPTION_NOTICE_SECONDS = 30
POD_SHUTDOWN_SECONDS = 15

CONTROLLERS = ["node-lifecycle-controller", "taint-eviction-controller",
               "pod-garbage-collector-controller", "disruption-controller"]
CONTROLLER_FLAGS = [
    f"--node-monitor-grace-period={NODE_MONITOR_GRACE_SECONDS}s",
    f"--node-monitor-period={NODE_MONITOR_PERIOD_SECONDS}s",
    # The ground's nodes carry no zone label, so they are one zone; the default eviction
    # rate (one node every 10 s) and the unhealthy-zone rule stay as on GKE.
]
APISERVER_FLAGS = [
    # The tolerations every pod gets by default (admission plugin DefaultTolerationSeconds).
    f"--default-not-ready-toleration-seconds={TOLERATION_SECONDS}",
    f"--default-unreachable-toleration-seconds={TOLERATION_SECONDS}",
]

SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."


def micro_time(at: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if at is None else at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def seconds_time(at: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if at is None else at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- pure parts ----------------------------------------------------------------------------


def node_lease(name: str, uid: str, renew: str) -> dict:
    """The Lease a kubelet keeps for its node (owned by the Node, so it goes with it)."""
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": LEASE_NAMESPACE,
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid}]},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": renew}}


def ready_condition(ready: bool, now: str, since: str, message: str = "") -> dict:
    return {"type": "Ready", "status": "True" if ready else "False",
            "reason": "KubeletReady" if ready else "KubeletNotReady",
            "message": message or ("node agent of the test ground" if ready else "node is not ready"),
            "lastHeartbeatTime": now, "lastTransitionTime": since}


def condition(node, kind: str = "Ready"):
    return next((c for c in (node.status.conditions or []) if c.type == kind), None) if node.status else None


def shutdown_status(containers, exit_code: int, now: str, restarts: int) -> dict:
    """A pod's status after the kubelet's graceful node shutdown (kubelet's nodeshutdown
    manager): Failed, reason Terminated, the DisruptionTarget condition, and its containers
    terminated with the code they ended with (143 after SIGTERM, 137 after SIGKILL)."""
    code = exit_code if exit_code >= 0 else 128 - exit_code
    terminated = {"exitCode": code, "reason": "Error" if code else "Completed", "finishedAt": now}

    def cond(kind: str, value: bool, reason: str = "") -> dict:
        item = {"type": kind, "status": "True" if value else "False", "lastTransitionTime": now,
                "lastProbeTime": None}
        return dict(item, reason=reason) if reason else item

    return {"status": {
        "phase": "Failed", "reason": "Terminated", "message": SHUTDOWN_MESSAGE,
        "conditions": [cond("PodScheduled", True), cond("Initialized", True), cond("ContainersReady", False),
                       cond("Ready", False), cond("DisruptionTarget", True, "TerminationByKubelet")],
        "containerStatuses": [{"name": c.name, "ready": False, "started": False, "restartCount": restarts,
                               "image": c.image, "imageID": "", "state": {"terminated": terminated}}
                              for c in containers]}}


# ---- in the agent ----------------------------------------------------------------------------


class NodeLife:
    """Heartbeats and failures of the simulated nodes, for one NodeAgent (`agent`): it reads
    the agent's pod runs and stops their processes, and tells the agent which nodes are down
    (`is_down`: the agent starts nothing there)."""

    def __init__(self, agent):
        self.agent = agent
        self.core = agent.core
        self.coordination = client.CoordinationV1Api(agent.core.api_client)
        self.nodes: dict[str, object] = {}  # name -> the Node as the watch last delivered it
        self.down: set[str] = set()  # uids of nodes whose VM is off or shutting down
        self.lock = threading.Lock()

    # -- what the agent asks

    def node(self, name: str):
        """The Node (None when there is none): from the watch, or read when it has not
        delivered it yet (a pod bound to a node created a moment ago)."""
        node = self.nodes.get(name)
        if node is None:
            try:
                node = self.core.read_node(name)
            except ApiException as error:
                if error.status == 404:
                    return None
                raise
        return node

    def is_down(self, name: str) -> bool:
        node = self.nodes.get(name)
        return node is not None and node.metadata.uid in self.down

    def start(self) -> None:
        threading.Thread(target=self.watch_nodes, daemon=True).start()
        threading.Thread(target=self.heartbeats, daemon=True).start()

    # -- the watch

    def watch_nodes(self) -> None:
        def listed(items) -> None:
            for gone in set(self.nodes) - {n.metadata.name for n in items}:
                self.gone(self.nodes[gone])
            for node in items:
                self.seen(node)

        def event(kind: str, node) -> None:
            # A node that stops matching the selector (relabelled) arrives as DELETED.
            self.gone(node) if kind == "DELETED" else self.seen(node)

        list_and_watch(self.core.list_node, listed, event, self.agent.stop_event, "node",
                       label_selector=f"{SIMULATED_LABEL}=true")

    def seen(self, node) -> None:
        name, uid = node.metadata.name, node.metadata.uid
        previous = self.nodes.get(name)
        if previous is not None and previous.metadata.uid != uid:
            self.gone(previous)  # recreated under the same name: the old VM is gone
        self.nodes[name] = node
        fault = (node.metadata.annotations or {}).get(FAULT_ANNOTATION)
        with self.lock:
            if fault not in (KILLED, PREEMPTED) or uid in self.down:
                return
            self.down.add(uid)
        if fault == KILLED:
            self.kill(name)
        else:
            threading.Thread(target=self.preempt, args=(node,), daemon=True).start()

    def gone(self, node) -> None:
        """The Node is deleted (or no longer one of ours): its VM is gone with every process."""
        name, uid = node.metadata.name, node.metadata.uid
        if self.nodes.get(name) is not None and self.nodes[name].metadata.uid == uid:
            del self.nodes[name]
        self.kill(name)
        self.agent.forget_node(name)
        with self.lock:
            self.down.discard(uid)

    # -- failures

    def runs_on(self, name: str) -> list:
        return [run for run in list(self.agent.runs.values()) if run.node == name]

    def kill(self, name: str) -> None:
        runs = self.runs_on(name)  # the agent neither restarts nor reports them (is_down)
        for run in runs:
            self.agent.signal_pod(run, signal.SIGKILL)
        if runs:
            log.info("node %s: killed %d pod(s)", name, len(runs))

    def preempt(self, node) -> None:
        name = node.metadata.name
        notice = time.monotonic()
        log.info("node %s: preemption notice", name)
        self.set_ready(node, False, "node is shutting down")
        runs = self.runs_on(name)
        threads = [threading.Thread(target=self.shut_down_pod, args=(run,), daemon=True) for run in runs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.agent.stop_event.wait(max(0.0, PREEMPTION_NOTICE_SECONDS - (time.monotonic() - notice)))
        log.info("node %s: the Spot VM is off; its Node is deleted", name)
        self.kill(name)
        try:
            self.core.delete_node(name)
        except ApiException as error:
            if error.status != 404:
                log.warning("deleting node %s: %s", name, error)

    def shut_down_pod(self, run) -> None:
        """The kubelet's graceful node shutdown of one pod: its preStop hook, SIGTERM to the
        container's main process (as a container runtime sends it to PID 1; Ray's handler then drains the
        node), SIGKILL to everything after its share of the notice, then its status."""
        pod = self.agent.pods.get(run.uid)
        grace = POD_SHUTDOWN_SECONDS
        if pod is not None and pod.spec.termination_grace_period_seconds is not None:
            grace = min(grace, pod.spec.termination_grace_period_seconds)
        started = time.monotonic()
        self.agent.run_pre_stop(run, grace)  # graceful node shutdown runs preStop hooks too
        if run.proc is not None and run.proc.poll() is None:
            os.kill(run.proc.pid, signal.SIGTERM)
        code = None
        if run.proc is not None:
            try:
                code = run.proc.wait(max(2.0, grace - (time.monotonic() - started)))
            except Exception:  # subprocess.TimeoutExpired: past its share of the notice
                pass
        self.agent.signal_pod(run, signal.SIGKILL)
        if run.proc is not None and code is None:
            code = run.proc.wait()
        log.info("pod %s/%s: shut down with the node (exit %s)", run.namespace, run.name, code)
        if pod is not None:
            self.agent.patch_status(run, shutdown_status(pod.spec.containers, code or 0, seconds_time(),
                                                                run.mains[0].restarts))

    # -- heartbeats

    def heartbeats(self) -> None:
        reported: dict[str, float] = {}  # node uid -> when its Ready condition was last written
        while not self.agent.stop_event.is_set():
            for node in list(self.nodes.values()):
                uid = node.metadata.uid
                if uid in self.down:
                    continue
                try:
                    self.renew_lease(node)
                    ready = condition(node)
                    if (ready is None or ready.status != "True"
                            or time.monotonic() - reported.get(uid, 0) > STATUS_SECONDS):
                        self.set_ready(node, True)
                        reported[uid] = time.monotonic()
                except ApiException as error:
                    if error.status != 404:  # a node deleted a moment ago
                        log.warning("heartbeat of %s: %s", node.metadata.name, error)
                except Exception as error:
                    log.warning("heartbeat of %s: %s", node.metadata.name, error)
            live = {n.metadata.uid for n in self.nodes.values()}
            for uid in set(reported) - live:
                del reported[uid]
            self.agent.stop_event.wait(RENEW_SECONDS)

    def renew_lease(self, node) -> None:
        name = node.metadata.name
        body = node_lease(name, node.metadata.uid, micro_time())
        try:
            self.coordination.patch_namespaced_lease(
                name, LEASE_NAMESPACE, {"spec": body["spec"]}, _content_type="application/merge-patch+json")
        except ApiException as error:
            if error.status != 404:
                raise
            try:
                self.coordination.create_namespaced_lease(LEASE_NAMESPACE, body)
            except ApiException as conflict:
                if conflict.status != 409:
                    raise

    def set_ready(self, node, ready: bool, message: str = "") -> None:
        now = seconds_time()
        current = condition(node)
        since = (current.last_transition_time if current is not None and (current.status == "True") == ready
                 and current.last_transition_time else None)
        since = seconds_time(since.timestamp()) if since is not None else now
        self.core.patch_node_status(
            node.metadata.name, {"status": {"conditions": [ready_condition(ready, now, since, message)]}},
            _content_type="application/strategic-merge-patch+json")
