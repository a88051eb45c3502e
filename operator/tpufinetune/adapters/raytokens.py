"""Thin adapter for the Ray tokens of the runs (the rules are in core/raytoken.py).

- The signing key: one Secret in the operator's namespace, read (get, by name: the only
  Secret the operator may read) or, at first use, created with 32 random bytes. Two
  operators racing to create it both end up with the one that won (409, then read).
- Each run's token Secret and NetworkPolicy are created just before its RayCluster, never
  read back (create only: 409 means they are already there, from an earlier step).
"""

from __future__ import annotations

import base64
import logging
import secrets
import threading

from kubernetes import client
from kubernetes.client.rest import ApiException

from tpufinetune.core import raytoken
from tpufinetune.core.phases import Identity

log = logging.getLogger(__name__)


class SigningKeyError(RuntimeError):
    """The signing key Secret is missing its key or cannot be read; the message says why."""


class RayTokens:
    def __init__(self, api: client.ApiClient, operator_namespace: str, timeout: tuple[float, float] | None = None):
        self.core = client.CoreV1Api(api)
        self.timeout = timeout  # every call's (connect, answer) bound, as KubeBackend's
        self.networking = client.NetworkingV1Api(api)
        self.operator_namespace = operator_namespace
        self._key: bytes | None = None
        self._lock = threading.Lock()

    def key(self) -> bytes:
        """The signing key (blocking: run in a thread), read once and kept."""
        with self._lock:
            if self._key is None:
                self._key = self._read_or_create_key()
            return self._key

    def _read_or_create_key(self) -> bytes:
        name, namespace = raytoken.SIGNING_KEY_SECRET, self.operator_namespace
        try:
            return self._key_of(self.core.read_namespaced_secret(name, namespace, _request_timeout=self.timeout))
        except ApiException as error:
            if error.status != 404:
                raise
        body = client.V1Secret(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace, labels={
                "app.kubernetes.io/name": "tpufinetune-operator", "app.kubernetes.io/part-of": "tpufinetune"}),
            type="Opaque",
            data={raytoken.SIGNING_KEY_FIELD: base64.b64encode(secrets.token_bytes(raytoken.SIGNING_KEY_BYTES)).decode()})
        try:
            created = self.core.create_namespaced_secret(namespace, body, _request_timeout=self.timeout)
            log.info("created the Ray token signing key %s/%s", namespace, name)
            return self._key_of(created)
        except ApiException as error:
            if error.status != 409:  # another replica made it first: use theirs
                raise
        return self._key_of(self.core.read_namespaced_secret(name, namespace, _request_timeout=self.timeout))

    def _key_of(self, secret) -> bytes:
        value = (secret.data or {}).get(raytoken.SIGNING_KEY_FIELD)
        if not value:
            raise SigningKeyError(
                f"Secret {self.operator_namespace}/{raytoken.SIGNING_KEY_SECRET} has no "
                f"data.{raytoken.SIGNING_KEY_FIELD}; delete it and the operator creates a new key "
                "(the heads of running RayClusters then refuse the operator until they are rebuilt)")
        return base64.b64decode(value)

    def token(self, ident: Identity) -> str:
        return raytoken.derive_token(self.key(), ident.namespace, ident.name, ident.uid)

    def create_for_run(self, ident: Identity) -> None:
        """The run's token Secret and NetworkPolicy (blocking). Already there (409): fine,
        they carry the same token and rules."""
        secret = raytoken.token_secret(ident.name, ident.namespace, ident.uid, self.token(ident))
        policy = raytoken.network_policy(ident.name, ident.namespace, ident.uid, self.operator_namespace)
        for create, body in ((self.core.create_namespaced_secret, secret),
                             (self.networking.create_namespaced_network_policy, policy)):
            try:
                create(ident.namespace, body, _request_timeout=self.timeout)
            except ApiException as error:
                if error.status != 409:
                    raise
