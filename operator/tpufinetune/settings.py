"""Operator settings, from environment variables (a ConfigMap or Helm values set them).

| variable | default | meaning |
|---|---|---|
| TPUFT_DASHBOARD_URL | http://{service}.{namespace}.svc:8265 | Ray dashboard address; `{service}`, `{namespace}` and `{cluster}` are filled from the RayCluster's head service. Set a fixed URL to reach a Ray head elsewhere (a port-forward, a local head). |
| TPUFT_RAY_TOKEN_FILE | (none) | only with a fixed TPUFT_DASHBOARD_URL (no `{...}` in it: a port-forward, `run --local`): file holding that head's Ray auth token, sent as `Authorization: Bearer`. Otherwise each run's head gets its own derived token (core/raytoken.py) and this is not used |
| TPUFT_RAY_TOKEN | (none) | the same token itself, when a file is not practical |
| TPUFT_OPERATOR_NAMESPACE | tpufinetune-system | the operator's own namespace (the Deployment sets it from the downward API): where the leader-election Lease and the Ray token signing key Secret live, and the namespace each run's NetworkPolicy admits to the Ray dashboard |
| TPUFT_POLL_INTERVAL | 5 | seconds between looks at a running job (new log lines wake the loop sooner) |
| TPUFT_PROVISION_TIMEOUT | 1800 | seconds to wait for a RayCluster to become ready before failing and releasing it |
| TPUFT_SUBMIT_TIMEOUT | 900 | seconds a run may stay in Submitting (its preflight, with spec.preflight, and the submit) before the attempt ends with reason SubmitTimeout: a preflight that never ends (a hung all_reduce, a stuck host) does not hold the slice. The next attempt runs on a new RayCluster, counted against spec.maxRetries; with none left the run fails and the slice is released |
| TPUFT_RAY_TIMEOUT | 10 | seconds any one call to a Ray head may take (connect and answer); a head that accepts connections and never answers costs no more |
| TPUFT_RAY_UNREACHABLE_TIMEOUT | 600 | seconds a submitting or running job's head may stay unreachable (down, crash-looping, refusing the token, or its token not derivable because the signing key cannot be read) before the attempt ends with reason RayUnreachable: the next attempt runs on a new RayCluster, counted against spec.maxRetries; with none left the run fails and the slice is released. Until then status.message and a Warning Event say why |
| TPUFT_STALL_TIMEOUT | 300 | seconds runs' status writes may fail for the operator's reasons (no answer, 5xx, its own credentials, throttling), with no status read or written by any run, before /healthz fails so that Kubernetes restarts it; a write the API server refuses for the run itself (admission, 403, 422) never fails it |
| TPUFT_KUBE_TIMEOUT | 30 | seconds any one Kubernetes API call may take (connect and answer); an API server that never answers holds one worker thread no longer |
| TPUFT_STATUS_WRITE_INTERVAL | 1 | least seconds between two status writes of one run within a phase: a chatty trainer's events are gathered into fewer writes; a write that changes the phase goes at once |
| TPUFT_RAY_THREADS | 32 | threads for calls to Ray heads (the Job API client blocks): as many heads that never answer can each hold one for TPUFT_RAY_TIMEOUT before other runs' Ray calls wait; Kubernetes calls never wait on them (a pool of their own) |
| TPUFT_KUBE_THREADS | 32 | threads for Kubernetes API calls (status writes, RayCluster and pod reads, creates), and the client's connections kept to the API server |
| TPUFT_NAMESPACE | (all) | watch only these namespaces: names or globs (`team-*`), separated by spaces or commas. One name: the operator's caches watch that namespace; several, or a glob: one cluster-wide watch each (RBAC: deploy/overlays/several-namespaces). The shipped installs set it (ml-team) |
| TPUFT_NOTIFY_SINKS_FILE | /etc/tpufinetune/notify/sinks.yaml | YAML or JSON file (a ConfigMap's key, mounted; no file: no sinks) naming the sinks spec.notify may send notices to: `sinks: [{name, type: webhook or cloudevents, url, mode: binary or structured, tokenFile, namespaces}]` (core/notify.py; docs/api.md, "Notices"); `namespaces` (required): the namespaces whose runs may name the sink (names, globs such as `team-*`, `"*"` for all). Only these URLs are ever called; read once at start |
| TPUFT_RUN_METRICS | true | export each run's own series on /metrics (tpufinetune_run_*: phase, loss, progress, throughput, cost; up to 12 series per run, see adapters/metrics.py); false keeps only the operator's own, whose series do not grow with the number of runs |
| TPUFT_LEADER_ELECTION | true | run kopf's handlers only while holding a Lease, so several replicas can run with one active; false for a single operator outside a cluster |
| TPUFT_LEASE_NAME | tpufinetune-operator | the coordination.k8s.io Lease the replicas compete for |
| TPUFT_LEASE_DURATION | 15 | seconds a standby waits, after the Lease last changed, before it takes over (leaseDurationSeconds) |
| TPUFT_RENEW_DEADLINE | 10 | seconds the leader may fail to renew before it stops acting and exits (Kubernetes restarts it as a standby); less than the lease duration |
| TPUFT_RETRY_PERIOD | 2 | seconds between the leader's renewals and a standby's tries |

The Lease's holderIdentity is the pod's name (POD_NAME from the downward API), else the
host name and process id.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tpufinetune.core.lease import timing_problem

DEFAULT_DASHBOARD_URL = "http://{service}.{namespace}.svc:8265"
DEFAULT_RAY_THREADS = 32  # also RayJobs' own default (run --local, tests)
PREFIX = "TPUFT_"


class SettingsError(ValueError):
    """A bad TPUFT_* variable; the message names it and says what to write."""


class Settings(BaseModel):
    """The operator's settings; each field is the variable TPUFT_<FIELD> (upper case)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dashboard_url: str = Field(DEFAULT_DASHBOARD_URL, min_length=1)
    ray_token: str = Field("", repr=False)
    poll_interval: float = Field(5.0, gt=0, le=3600)
    provision_timeout: float = Field(1800.0, gt=0)
    submit_timeout: float = Field(900.0, gt=0)
    ray_timeout: float = Field(10.0, gt=0, le=300)
    ray_unreachable_timeout: float = Field(600.0, gt=0)
    stall_timeout: float = Field(300.0, gt=0)
    kube_timeout: float = Field(30.0, gt=0, le=600)
    status_write_interval: float = Field(1.0, ge=0, le=60)
    ray_threads: int = Field(DEFAULT_RAY_THREADS, ge=1, le=1024)
    kube_threads: int = Field(32, ge=1, le=1024)
    namespace: str = ""
    notify_sinks_file: str = "/etc/tpufinetune/notify/sinks.yaml"
    run_metrics: bool = True
    operator_namespace: str = Field("tpufinetune-system", min_length=1, max_length=63)
    leader_election: bool = True
    lease_name: str = Field("tpufinetune-operator", min_length=1)
    lease_duration: float = Field(15.0, ge=1, le=3600)
    renew_deadline: float = Field(10.0, gt=0)
    retry_period: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _election_timing(self) -> Settings:
        problem = timing_problem(self.lease_duration, self.renew_deadline, self.retry_period)
        if self.leader_election and problem:
            raise ValueError(problem)
        return self

    @classmethod
    def from_env(cls, env: dict | None = None) -> Settings:
        env = os.environ if env is None else env
        values = {name: env[PREFIX + name.upper()] for name in cls.model_fields
                  if env.get(PREFIX + name.upper())}
        token_file = env.get(PREFIX + "RAY_TOKEN_FILE", "")
        if token_file:
            try:
                values["ray_token"] = Path(token_file).read_text().strip()
            except OSError as exc:
                raise SettingsError(f"{PREFIX}RAY_TOKEN_FILE: cannot read {token_file}: "
                                    f"{exc.strerror or exc}") from None
        try:
            return cls(**values)
        except ValidationError as exc:
            raise _settings_error(exc, values) from None

    def dashboard_for(self, cluster: str, namespace: str, service: str) -> str:
        return self.dashboard_url.format(cluster=cluster, namespace=namespace, service=service)

    @property
    def fixed_dashboard(self) -> bool:
        """One dashboard for every run (no `{...}` placeholder): a port-forward or a local
        head, reached with TPUFT_RAY_TOKEN; otherwise each run's own head and token."""
        return not any(f"{{{key}}}" in self.dashboard_url for key in ("service", "namespace", "cluster"))

    @property
    def namespaces(self) -> list[str]:
        """TPUFT_NAMESPACE's names and globs; [] is every namespace."""
        return self.namespace.replace(",", " ").split()

    @property
    def one_namespace(self) -> str:
        """The one namespace watched, when TPUFT_NAMESPACE names exactly one; else ""."""
        names = self.namespaces
        return names[0] if len(names) == 1 and not any(c in names[0] for c in "*?[") else ""

    def ray_headers(self) -> dict:
        return {"Authorization": f"Bearer {self.ray_token}"} if self.ray_token else {}


def _settings_error(exc: ValidationError, values: dict) -> SettingsError:
    first = exc.errors()[0]
    if not first["loc"]:  # a rule across fields: its message names them
        return SettingsError(str(first["ctx"]["error"]))
    name = str(first["loc"][0])
    variable = PREFIX + name.upper()
    given = values.get(name)
    if first["type"] in ("float_parsing", "float_type"):
        return SettingsError(f"{variable}={given!r} is not a number of seconds; write a "
                             "plain number, e.g. 5 (not 5s)")
    if first["type"] in ("int_parsing", "int_type", "int_from_float"):
        return SettingsError(f"{variable}={given!r} is not a whole number; write e.g. 32")
    if first["type"] == "bool_parsing":
        return SettingsError(f"{variable}={given!r}: write true or false")
    return SettingsError(f"{variable}={given!r}: {first['msg'].lower()}")
