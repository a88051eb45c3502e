"""A status write answered 429 Too Many Requests by the real kube-apiserver: the backend
waits the answer's Retry-After (holding no thread) and writes again, with no warning; the
waits of one call are bounded (core/retryafter.py), after which the 429 is the caller's
error.

The 429 is the API server's own (API Priority and Fairness, on by default), made
deterministic: a FlowSchema sends the status patches of deploy/'s ServiceAccount to a
priority level with no seats (nominalConcurrencyShares 0, nothing lent or borrowed) that
rejects what it cannot seat. APF still lets one request through while none of its level
executes (a request wider than the limit is never starved), so one status patch of another
object is held executing: a validating webhook (served here, over TLS) holds that patch's
admission until released. While it is held, every other patch of the account is answered
429 with Retry-After; once released, the next one goes through.

Checked to fail: with the 429 not waited out, the first write raises it at once. About
5 s on a running control plane.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from harness.admission import serve_webhook
from harness.pki import write_pki
from harness.service_account import rbac_objects, service_account_kubeconfig
from harness.waiting import wait_for
from tpufinetune.adapters.kube import KubeBackend
from tpufinetune.core.api import GROUP, PLURAL, VERSION
from tpufinetune.core.phases import Identity
from tpufinetune.settings import Settings

SPEC = {"tpu": {"generation": "v6e", "topology": "4x4"}, "image": "registry.example/t:1",
        "checkpoint": {"storagePath": "gs://bench/ckpt"}}
HOLDER_LABEL = "tpufinetune.dev/test-held"
HOLD_S = 25  # the webhook's answer waits at most this (the API server gives it 30)


def throttle(account: dict, name: str, webhook_url: str, ca: bytes) -> list[dict]:
    """A priority level without seats, the FlowSchema that sends the account's status
    patches of TPUFineTunes to it, and a webhook on the status of labelled TPUFineTunes."""
    return [
        {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "PriorityLevelConfiguration",
         "metadata": {"name": name},
         "spec": {"type": "Limited", "limited": {
             "nominalConcurrencyShares": 0, "lendablePercent": 0, "borrowingLimitPercent": 0,
             "limitResponse": {"type": "Reject"}}}},
        {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": name},
         "spec": {"priorityLevelConfiguration": {"name": name}, "matchingPrecedence": 10,
                  "distinguisherMethod": {"type": "ByUser"},
                  "rules": [{"subjects": [{"kind": "ServiceAccount", "serviceAccount": {
                      "name": account["name"], "namespace": account["namespace"]}}],
                             "resourceRules": [{"verbs": ["patch"], "apiGroups": [GROUP],
                                                "resources": [f"{PLURAL}/status"], "namespaces": ["*"]}]}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
         "metadata": {"name": name},
         "webhooks": [{"name": "hold.test.tpufinetune.dev", "sideEffects": "None", "admissionReviewVersions": ["v1"],
                       "clientConfig": {"url": webhook_url, "caBundle": base64.b64encode(ca).decode()},
                       "rules": [{"apiGroups": [GROUP], "apiVersions": [VERSION], "operations": ["UPDATE"],
                                  "resources": [f"{PLURAL}/status"], "scope": "Namespaced"}],
                       "objectSelector": {"matchLabels": {HOLDER_LABEL: "true"}},
                       "timeoutSeconds": 30, "failurePolicy": "Ignore"}]},
    ]


class HoldingWebhook:
    """An admission webhook that allows everything, each answer held until `release`."""

    def __init__(self, pki):
        self.arrived, self.release = threading.Event(), threading.Event()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                hook.arrived.set()
                hook.release.wait(HOLD_S)
                answer = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                     "response": {"uid": review["request"]["uid"], "allowed": True}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server, self.url = serve_webhook(Handler, pki, "hold")

    def stop(self):
        self.release.set()
        self.server.shutdown()


def apply_run(control_plane, namespace: str, name: str, labels: dict | None = None) -> None:
    control_plane.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(
        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TPUFineTune",
         "metadata": {"name": name, "labels": labels or {}}, "spec": SPEC}))


@pytest.fixture
def throttled_run(control_plane, namespace, tmp_path):
    """(an API client of deploy/'s ServiceAccount, a TPUFineTune, release()): the account's
    status patches are answered 429 by the API server until release()."""
    name = f"tft-test-throttle-{uuid.uuid4().hex[:6]}"
    write_pki(tmp_path)
    webhook = HoldingWebhook(tmp_path)
    rbac = rbac_objects(control_plane)
    account = next(o["metadata"] for o in rbac if o["kind"] == "ServiceAccount")
    api = config.new_client_from_config(config_file=str(service_account_kubeconfig(control_plane, tmp_path / "kc", rbac, [namespace])))
    objects = client.CustomObjectsApi(api)
    apply_run(control_plane, namespace, "slow")
    apply_run(control_plane, namespace, "holder", {HOLDER_LABEL: "true"})
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(
        throttle(account, name, webhook.url, (tmp_path / "ca.crt").read_bytes())))

    def patch(run: str, message: str) -> None:
        objects.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, run,
                                                      {"status": {"message": message}}, _request_timeout=HOLD_S + 10)

    def hold() -> bool:
        """One status patch of `holder` held in its admission (so executing in the level)."""
        holder = threading.Thread(target=patch, args=("holder", "held"), daemon=True)
        holder.start()
        if webhook.arrived.wait(3):
            return True
        holder.join()  # the FlowSchema or the webhook was not in force yet: again
        return False

    def refused() -> bool:
        try:
            patch("slow", "probe")
        except ApiException as error:
            assert error.status == 429, error
            assert error.headers.get("Retry-After"), "the API server's 429 carries Retry-After"
            return True
        return False

    try:
        wait_for(hold, 60, "a status patch held in the webhook", interval=0)
        wait_for(refused, 10, "the API server to answer the account's status patches 429")
        body = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "slow")
        yield api, body, webhook.release.set
    finally:
        webhook.stop()
        control_plane.kubectl("delete", "flowschema,prioritylevelconfiguration,validatingwebhookconfiguration",
                              name, "--ignore-not-found", "--wait=false")
        api.close()


def test_a_status_write_answered_429_waits_retry_after_and_is_sent_again(throttled_run, caplog):
    api, body, release = throttled_run
    meta = body["metadata"]
    ident = Identity(meta["name"], meta["namespace"], meta["uid"])
    backend = KubeBackend(api, Settings())

    async def bounded():
        backend.throttle_budget = 2.5  # waits of 1 s (the server's Retry-After): two, then the 429
        started = time.monotonic()
        with pytest.raises(ApiException) as refused:
            await backend.write_status(ident, {"message": "one"}, {}, meta["resourceVersion"])
        return refused.value, time.monotonic() - started

    caplog.set_level(logging.INFO, logger="tpufinetune")
    error, took = asyncio.run(bounded())
    assert error.status == 429 and backend.throttled.count >= 1
    assert took >= backend.throttled.count * 1.0  # it waited the server's Retry-After (1 s at least) each time

    async def goes_through():
        backend.throttle_budget = 60.0
        write = asyncio.create_task(backend.write_status(ident, {"message": "two"}, {}, meta["resourceVersion"]))
        refusals = backend.throttled.count
        while backend.throttled.count == refusals:  # refused again: the write is waiting its Retry-After
            assert not write.done()
            await asyncio.sleep(0.05)
        release()  # nothing of the level executes any more: the next patch goes through
        return await asyncio.wait_for(write, 30)

    version = asyncio.run(goes_through())
    written = client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, meta["namespace"], PLURAL,
                                                                         meta["name"])
    assert written["status"]["message"] == "two" and written["metadata"]["resourceVersion"] == version
    # Waiting is not an error: one INFO line for the burst of 429s, nothing louder.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    throttled_lines = [r for r in caplog.records if "429" in r.getMessage()]
    assert len(throttled_lines) == 1
