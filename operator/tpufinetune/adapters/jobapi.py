"""Ray's Job REST API over plain HTTP (requests), so the operator never imports `ray`.

Ray's own client (`ray.job_submission.JobSubmissionClient`) is the same few HTTP calls,
but importing it loads most of Ray: about 34 MB of the operator's RSS, once, for nothing
it uses (issue 21: RSS < 250 MB at scale). This module speaks the same wire format as
Ray 2.60's client (ray/dashboard/modules/job/sdk.py and dashboard_sdk.py): the same
endpoints and JSON bodies, and errors worded as Ray words them, status code and body,
so callers that match on them ("already exists", "Authentication failed: ") still do.

What it leaves out, because the operator never needs it: uploading a local working_dir
or py_modules (a runtime_env here holds env_vars and remote URIs only; a local path is
refused before any request), Ray's address resolution (`ray://`, `auto`, RAY_ADDRESS:
the address given is the head's dashboard URL, always) and Ray's own token discovery
(the caller sends `Authorization: Bearer <token>` in `headers`) and Ray's `verify` (an
https head's certificate is checked against the system's CAs, the default of Ray's client).
"""

from __future__ import annotations

import requests


MIN_RAY_MAJOR = 2  # Ray's client refuses a head older than 2.0 too


class AuthenticationError(RuntimeError):
    """The head refused the request's token: 401 (none sent) or 403 (not this one). A
    RuntimeError, as every other refusal, but its own class so that a refused token is
    never mistaken for a job the head does not know."""


def auth_error_message(status: int, body: str) -> str | None:
    """Ray's wording of a refused token (it starts "Authentication required: " or
    "Authentication failed: "), with the status code; None for any other status."""
    if status == 401:
        return f"Authentication required: {body}\n\nThe head answered 401: it needs a token and none was sent."
    if status == 403:
        return f"Authentication failed: {body}\n\nThe head answered 403: the token sent is not its token."
    return None


def _is_local_path(uri) -> bool:
    return isinstance(uri, str) and "://" not in uri


def check_remote_only(runtime_env: dict) -> None:
    """Refuse a runtime_env that names a local directory: Ray's client would zip and upload
    it first, which this client does not do; sent as is, the head would look for the path
    on its own disk."""
    modules = runtime_env.get("py_modules") or []
    local = [p for p in [runtime_env.get("working_dir"), *modules] if _is_local_path(p)]
    if local:
        raise ValueError(f"runtime_env names local paths {local}: only remote URIs (gcs://, s3://, https://) "
                         "can be sent without Ray's client to upload them")


class JobApiClient:
    """Ray's Job API at one head's dashboard address. Each request is its own connection,
    as with Ray's client: no pooled connection that the head closed while idle (its
    keep-alive ends long before a waiting run's next call) is ever reused, and threads
    share nothing but the headers. Every request has a connect and read
    timeout (`timeout` seconds): a head that accepts connections and never answers holds
    the calling thread that long, not for ever. Blocking: call it from a worker thread.

    Like Ray's client, creating one asks the head its version, so an address with no
    head behind it fails here (ConnectionError), once, not on every later call."""

    def __init__(self, address: str, headers: dict | None = None, timeout: float = 10.0):
        self._address = address.rstrip("/")
        self._headers = dict(headers or {})
        self._timeout = timeout
        self._check_connection_and_version()

    # ---- the HTTP layer, named and worded as Ray's (dashboard_sdk.SubmissionClient)

    def _do_request(self, method: str, endpoint: str, *, data: bytes | None = None,
                    json_data: dict | None = None, **kwargs) -> requests.Response:
        """One request; a refused token raises AuthenticationError at once, whatever the
        endpoint, so no caller reads a 401 or 403 as an answer about a job."""
        kwargs.setdefault("timeout", self._timeout)
        response = requests.request(method, self._address + endpoint, headers=self._headers,
                                    data=data, json=json_data, **kwargs)
        message = auth_error_message(response.status_code, response.text)
        if message:
            raise AuthenticationError(message)
        return response

    def _raise_error(self, response: requests.Response):
        """Ray's error for any other refusal: the status code and the head's whole body
        (the body says why: "Job with submission_id ... already exists", a traceback)."""
        raise RuntimeError(f"Request failed with status code {response.status_code}: {response.text}.")

    def _json(self, response: requests.Response):
        if response.status_code != 200:
            self._raise_error(response)
        return response.json()

    def _check_connection_and_version(self) -> None:
        """GET /api/version, as Ray's client does when created: no head (ConnectionError),
        a server without the Job API (404) or a head older than Ray 2 (RuntimeError)."""
        try:
            response = self._do_request("GET", "/api/version")
        except requests.exceptions.ConnectionError:
            raise ConnectionError(f"Failed to connect to Ray at address: {self._address}.") from None
        if response.status_code == 404:
            raise RuntimeError("Version check returned 404. Jobs API is not supported on the Ray cluster. "
                               "Please ensure the cluster is running Ray 2.0 or higher.")
        response.raise_for_status()
        version = response.json()["ray_version"]
        if int(version.split(".")[0]) < MIN_RAY_MAJOR:
            raise RuntimeError(f"Ray version {version} is running on the cluster. "
                               "Please ensure the cluster is running Ray 2.0 or higher.")

    # ---- the Job API

    def submit_job(self, *, entrypoint: str, submission_id: str | None = None,
                   runtime_env: dict | None = None, metadata: dict | None = None) -> str:
        """POST /api/jobs/ with Ray's body (entrypoint, submission_id, runtime_env,
        metadata; runtime_env and metadata sent as {} when none, None fields left out).
        The head refuses a submission id it has seen: "Request failed with status code
        500: ... Job with submission_id ... already exists ..." (Ray 2.60's head wraps its
        job agent's 400 in a 500; only the words are stable)."""
        runtime_env = dict(runtime_env or {})
        check_remote_only(runtime_env)
        body = {"entrypoint": entrypoint, "submission_id": submission_id,
                "runtime_env": runtime_env, "metadata": dict(metadata or {})}
        body = {key: value for key, value in body.items() if value is not None}
        return self._json(self._do_request("POST", "/api/jobs/", json_data=body))["submission_id"]

    def job_or_none(self, submission_id: str) -> dict | None:
        """GET /api/jobs/{id}: the job's details as the head sends them (Ray's JobDetails
        fields: status, message, job_id, submission_id, driver_node_id, ...), or None only
        when the head answers 404: a job lost is decided on the status code, never on words
        in an error body."""
        response = self._do_request("GET", f"/api/jobs/{submission_id}")
        if response.status_code == 404:
            return None
        return self._json(response)

    def get_job_logs(self, job_id: str) -> str:
        """GET /api/jobs/{id}/logs: the driver's whole log (for a short job only)."""
        return self._json(self._do_request("GET", f"/api/jobs/{job_id}/logs"))["logs"]

    def stop_if_exists(self, submission_id: str) -> bool:
        """POST /api/jobs/{id}/stop: True if the job was running; False as well when the
        head has no such job (404): there is nothing left to stop."""
        response = self._do_request("POST", f"/api/jobs/{submission_id}/stop")
        if response.status_code == 404:
            return False
        return bool(self._json(response)["stopped"])
