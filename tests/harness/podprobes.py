"""A kubelet's container probes (pkg/kubelet/prober) for the ground's node agent.

Pure timing (`ProbeWorker`, `ContainerProbes`: fed the clock and each probe's outcome, as
prober/worker.go's doProbe) and the handlers a kubelet runs (`http_get`, `tcp_socket`; an
exec probe is run by the agent inside the container, `exec_outcome` words its result):

- A probe runs once its container has run `initialDelaySeconds`, then every
  `periodSeconds`, each given `timeoutSeconds`; its result is reported once it has repeated
  `successThreshold` (success) or `failureThreshold` (failure) times in a row.
- Readiness starts as failure (not Ready until a probe passes); liveness as success. A
  reported liveness or startup failure puts the worker on hold: the agent kills the
  container, and a new container gets new workers.
- With a startup probe, liveness and readiness wait until it has passed (`started`).
- HTTP and TCP probes go straight to the pod's address (`httpGet.host` if given), never
  through an HTTP proxy of the agent's environment; success is a status in [200, 400).
- gRPC probes do not run on the ground (tests/README.md).
"""

from __future__ import annotations

import json
import socket
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass

LIVENESS, READINESS, STARTUP = "Liveness", "Readiness", "Startup"  # as the kubelet's events name them
SPEC_FIELDS = {STARTUP: "startupProbe", LIVENESS: "livenessProbe", READINESS: "readinessProbe"}
HANDLERS = ("exec", "httpGet", "tcpSocket")
MAX_OUTPUT = 10 * 1024  # the kubelet keeps this much of a probe's output or body
USER_AGENT = "kube-probe/1.35"

# A kubelet's probes go straight to the pod, never through an HTTP proxy. urllib's default
# opener honours the environment's http_proxy, and the usual no_proxy (localhost,127.0.0.1)
# does not cover the pods' 127.N.x.y addresses: from a shell with a proxy set, no probe would
# ever reach a pod. HTTPS probes do not verify the pod's certificate (as a kubelet's).
_INSECURE = ssl.create_default_context()
_INSECURE.check_hostname = False
_INSECURE.verify_mode = ssl.CERT_NONE
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=_INSECURE))


@dataclass(frozen=True)
class Probe:
    """One probe of a container spec, with the API server's defaults."""
    kind: str  # LIVENESS | READINESS | STARTUP
    handler: str  # exec | httpGet | tcpSocket
    action: dict  # the handler's own fields
    initial_delay: int = 0
    period: int = 10
    timeout: int = 1
    success_threshold: int = 1
    failure_threshold: int = 3
    termination_grace: int | None = None  # the probe's terminationGracePeriodSeconds


def probes_of(container: dict) -> dict[str, Probe]:
    """The container's probes that run on the ground, by kind."""
    found = {}
    for kind, name in SPEC_FIELDS.items():
        spec = container.get(name)
        handler = next((h for h in HANDLERS if (spec or {}).get(h) is not None), None)
        if handler is None:  # no probe, or a gRPC one
            continue
        found[kind] = Probe(kind, handler, spec[handler], spec.get("initialDelaySeconds") or 0,
                            spec.get("periodSeconds") or 10, spec.get("timeoutSeconds") or 1,
                            spec.get("successThreshold") or 1, spec.get("failureThreshold") or 3,
                            spec.get("terminationGracePeriodSeconds"))
    return found


class ProbeWorker:
    """The timing and thresholds of one probe of one container (a kubelet's probe worker).
    Times are seconds on one monotonic clock; the container started at `started`."""

    def __init__(self, probe: Probe, started: float):
        self.probe = probe
        self.started = started
        self.next_at = started  # a worker probes when it starts, then on every tick
        self.result = probe.kind == LIVENESS  # reported so far: readiness and startup start failed
        self.last: bool | None = None
        self.run = 0  # how many times in a row `last` came
        self.on_hold = False  # a liveness or startup failure was reported: nothing more for this container

    def tick(self, now: float) -> bool:
        """Whether to probe now: on a tick (every period), once the initial delay is over."""
        if self.on_hold or now < self.next_at:
            return False
        while self.next_at <= now:  # a late tick is not made up (a Go ticker drops them)
            self.next_at += self.probe.period
        return now - self.started >= self.probe.initial_delay

    def record(self, success: bool) -> bool | None:
        """One probe's outcome; the result reported now (past its threshold), or None."""
        if success == self.last:
            self.run += 1
        else:
            self.last, self.run = success, 1
        if self.run < (self.probe.success_threshold if success else self.probe.failure_threshold):
            return None
        self.result = success
        if not success and self.probe.kind in (LIVENESS, STARTUP):
            self.on_hold, self.run = True, 0
        return success


class ContainerProbes:
    """The probe workers of one running container."""

    def __init__(self, container: dict, started: float):
        self.workers = {kind: ProbeWorker(probe, started) for kind, probe in probes_of(container).items()}

    @property
    def started(self) -> bool:
        """The kubelet's `started`: the startup probe has passed (at once without one)."""
        startup = self.workers.get(STARTUP)
        return startup is None or startup.result

    @property
    def ready(self) -> bool:
        """Started, and the readiness probe has passed (at once without one)."""
        readiness = self.workers.get(READINESS)
        return self.started and (readiness is None or readiness.result)

    def due(self, now: float) -> list[ProbeWorker]:
        """The workers that probe now: the startup one until it passes, then the others."""
        if not self.started:
            workers = [self.workers[STARTUP]]
        else:
            workers = [w for kind, w in self.workers.items() if kind != STARTUP]
        return [w for w in workers if w.tick(now)]


@dataclass(frozen=True)
class Outcome:
    success: bool
    output: str = ""  # what a failure's event says after "<Kind> probe failed: "


def port_number(port, container: dict) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"port {port!r} names no port of container {container.get('name')!r}")


def http_get(url: str, headers: dict[str, str], timeout: float) -> Outcome:
    """An HTTP probe, in the kubelet's words for each failure."""
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, "Accept": "*/*", **headers})
    try:
        with DIRECT.open(request, timeout=timeout) as response:
            code = response.status
            body = response.read(MAX_OUTPUT)
    except urllib.error.HTTPError as error:
        code, body = error.code, b""
    except (TimeoutError, socket.timeout):
        return Outcome(False, f'Get "{url}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)')
    except urllib.error.URLError as error:
        return Outcome(False, f'Get "{url}": {_dial_error(url, error.reason)}')
    except OSError as error:
        return Outcome(False, f'Get "{url}": {_dial_error(url, error)}')
    if 200 <= code < 400:
        return Outcome(True, body.decode(errors="replace"))
    return Outcome(False, f"HTTP probe failed with statuscode: {code}")


def _dial_error(url: str, reason) -> str:
    address = url.split("://", 1)[-1].split("/", 1)[0]
    if isinstance(reason, ConnectionRefusedError):
        return f"dial tcp {address}: connect: connection refused"
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"dial tcp {address}: i/o timeout"
    return str(reason)


def tcp_socket(host: str, port: int, timeout: float) -> Outcome:
    """A TCP probe: the port accepts a connection."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return Outcome(True)
    except ConnectionRefusedError:
        return Outcome(False, f"dial tcp {host}:{port}: connect: connection refused")
    except (TimeoutError, socket.timeout):
        return Outcome(False, f"dial tcp {host}:{port}: i/o timeout")
    except OSError as error:
        return Outcome(False, f"dial tcp {host}:{port}: {error}")


def exec_outcome(command: list[str], code: int | None, output: bytes) -> Outcome:
    """An exec probe's result from its exit code (None: it ran past its timeout)."""
    if code is None:
        return Outcome(False, f"command {json.dumps(' '.join(command))} timed out")  # Go's %q
    return Outcome(code == 0, output[:MAX_OUTPUT].decode(errors="replace"))
