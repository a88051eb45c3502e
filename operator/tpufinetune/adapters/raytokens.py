"""Thin adapter for the Ray tokens of the runs (the rules are in core/raytoken.py).

- The signing keyring: one Secret in the operator's namespace, read (get, by name: the only
  Secret the operator may read) or, at first use, created with one 32-byte key. Two
  operators racing to create it both end up with the one that won (409, then read). It is
  read again for every new RayCluster, when a head refuses a token (at most every
  REFUSED_REREAD_S), and at most KEYRING_TTL_S after the last read otherwise: a rotation
  needs no restart.
- Each RayCluster's token Secret (named and labelled with its key's id) and the run's
  NetworkPolicy are created just before the RayCluster, never read back (create only: 409
  means they are already there, from an earlier step).
- Which key a run's head takes: the one its cluster was made with, remembered here. A
  process that did not make the cluster (a restart, another replica) starts with the
  current key and, when the head refuses it, tries each older key of the keyring in turn
  (`refused`); a head that refuses them all is rebuilt (runray.RayAuthRefused).
"""

from __future__ import annotations

import base64
import logging
import secrets
import threading
import time

from kubernetes import client
from kubernetes.client.rest import ApiException

from tpufinetune.adapters import lease
from tpufinetune.core import raytoken
from tpufinetune.core.phases import Identity

log = logging.getLogger(__name__)
KEYRING_TTL_S = 60.0
# A head that refuses a token has the keyring read again (a rotation may have added the key
# it takes), but at most once in this many seconds for all refusals together: a hundred
# heads refusing at once cost one read of the Secret, not a hundred under one lock.
REFUSED_REREAD_S = 5.0


class SigningKeyError(RuntimeError):
    """The signing key Secret is missing its key or cannot be read; the message says why."""


class RayTokens:
    def __init__(self, api: client.ApiClient, operator_namespace: str, timeout: tuple[float, float] | None = None):
        self.core = client.CoreV1Api(api)
        self.timeout = timeout  # every call's (connect, answer) bound, as KubeBackend's
        self.networking = client.NetworkingV1Api(api)
        self.operator_namespace = operator_namespace
        self._keyring: raytoken.Keyring | None = None
        self._read_at = float("-inf")
        self._read_started = float("-inf")  # when the GET that gave the keyring was sent
        self._run_keys: dict[str, str] = {}  # run uid -> the key id its head is spoken to with
        self._refused: dict[str, set[str]] = {}  # run uid -> key ids its head refused
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return f"{self.operator_namespace}/{raytoken.SIGNING_KEY_SECRET}"

    def keyring(self, fresh: bool = False, max_age: float = KEYRING_TTL_S,
                read_since: float | None = None) -> raytoken.Keyring:
        """The keyring (blocking: run in a thread), read again when `fresh`, older than
        `max_age` seconds, or read by a GET sent before `read_since` (time.monotonic()).
        One that cannot be read (refused, no data.key, an entry not base64) raises
        SigningKeyError naming the Secret, the entry and the fix; the last good one is not
        used then: a key removed on purpose must stop being used."""
        with self._lock:
            if (fresh or self._keyring is None or time.monotonic() - self._read_at > max_age
                    or (read_since is not None and self._read_started < read_since)):
                started = time.monotonic()
                try:
                    data = self._read_or_create()
                except ApiException as error:
                    raise SigningKeyError(f"Secret {self.where} could not be read: {error.status} {error.reason}") \
                        from None
                try:
                    self._keyring = raytoken.parse_keyring(data, self.where)
                except raytoken.KeyringError as error:
                    raise SigningKeyError(str(error)) from None
                self._read_at, self._read_started = time.monotonic(), started
            return self._keyring

    def _read_or_create(self) -> dict:
        name, namespace = raytoken.SIGNING_KEY_SECRET, self.operator_namespace
        try:
            return self.core.read_namespaced_secret(name, namespace, _request_timeout=self.timeout).data
        except ApiException as error:
            if error.status != 404:
                raise
        body = client.V1Secret(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace, labels={
                "app.kubernetes.io/name": "tpufinetune-operator", "app.kubernetes.io/part-of": "tpufinetune"}),
            type="Opaque",
            data={raytoken.SIGNING_KEY_FIELD: base64.b64encode(secrets.token_bytes(raytoken.SIGNING_KEY_BYTES)).decode()})
        try:
            lease.check_held(f"creating the Ray token signing key {self.where}")
            created = self.core.create_namespaced_secret(namespace, body, _request_timeout=self.timeout)
            log.info("created the Ray token signing key %s", self.where)
            return created.data
        except ApiException as error:
            if error.status != 409:  # another replica made it first: use theirs
                raise
        return self.core.read_namespaced_secret(name, namespace, _request_timeout=self.timeout).data

    def key_for_new_cluster(self, ident: Identity) -> str:
        """The id of the current key, which the run's next RayCluster is made with; its
        head is spoken to with it from now on. Read afresh: by a GET sent after this call
        began, its own or another run's (a burst of new runs waits on one read at a time,
        and each read serves every run that was waiting for it, not one GET a run)."""
        current = self.keyring(read_since=time.monotonic()).current
        with self._lock:
            self._run_keys[ident.uid] = current
            self._refused.pop(ident.uid, None)
        return current

    def token(self, ident: Identity) -> str:
        """The run's token for its head: of the key its cluster was made with (the current
        one when not known here). A key removed from the keyring since is not used: the
        current one is tried instead, and a head that refuses it is handled by `refused`."""
        keyring = self.keyring()
        key_id = self._run_keys.get(ident.uid, keyring.current)
        if keyring.key(key_id) is None:  # removed since? the keyring read again says for sure
            keyring = self.keyring(fresh=True)
        if keyring.key(key_id) is None:
            log.warning("%s/%s: key %s is no longer in Secret %s; trying the current key %s",
                        ident.namespace, ident.name, key_id, self.where, keyring.current)
            key_id = keyring.current
            with self._lock:
                self._run_keys[ident.uid] = key_id
        return raytoken.derive_token(keyring.key(key_id), ident.namespace, ident.name, ident.uid)

    def refused(self, ident: Identity) -> str:
        """The run's head refused the token of its present key: the next key of the
        keyring (read again if older than REFUSED_REREAD_S) to try, its id; '' when the
        head refused every key, and the run's cluster must be rebuilt."""
        keyring = self.keyring(max_age=REFUSED_REREAD_S)
        with self._lock:
            tried = self._refused.setdefault(ident.uid, set())
            tried.add(self._run_keys.get(ident.uid, keyring.current))
            untried = [k for k in keyring.ids() if k not in tried]
            if not untried:
                self._refused.pop(ident.uid, None)
                return ""
            self._run_keys[ident.uid] = untried[0]
        log.info("%s/%s: the Ray head refused a token; trying key %s of the keyring",
                 ident.namespace, ident.name, untried[0])
        return untried[0]

    def create_for_run(self, ident: Identity) -> None:
        """The token Secret of the run's new RayCluster (of the key key_for_new_cluster
        chose) and the run's NetworkPolicy (blocking). Already there (409): fine, they
        carry the same token and rules."""
        key_id = self._run_keys.get(ident.uid) or self.key_for_new_cluster(ident)
        secret = raytoken.token_secret(ident.name, ident.namespace, ident.uid, self.token(ident), key_id)
        policy = raytoken.network_policy(ident.name, ident.namespace, ident.uid, self.operator_namespace)
        for create, body in ((self.core.create_namespaced_secret, secret),
                             (self.networking.create_namespaced_network_policy, policy)):
            try:
                lease.check_held(f"creating {body['kind']} {ident.namespace}/{body['metadata']['name']}")
                create(ident.namespace, body, _request_timeout=self.timeout)
            except ApiException as error:
                if error.status != 409:
                    raise

    def forget(self, ident: Identity) -> None:
        """The run is gone: its key and refusals are not kept."""
        with self._lock:
            self._run_keys.pop(ident.uid, None)
            self._refused.pop(ident.uid, None)
