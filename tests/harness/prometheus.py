"""Prometheus on the test ground: the real server (built by `make prometheus` from its pinned
Go module, tests/prometheus/) on a free loopback port, scraping fixed targets every second
into a temporary storage directory, and the few HTTP API calls the tests make.

    with Prometheus({"operator": [operator.metrics_url]}, workdir) as prometheus:
        prometheus.wait_up("operator")
        prometheus.query('tpufinetune_resources{phase="Succeeded"}')

Targets are URLs (`http://127.0.0.1:PORT/metrics`), by job name; every sample carries the
labels `job` and `instance` (`127.0.0.1:PORT`) as a static_configs scrape gives them, plus
`labels` (the target labels a Kubernetes scrape would attach: `namespace`, `pod`, ...). A
scraped label that clashes with a target label is renamed `exported_<label>` unless
`honor_labels` (Prometheus' rule, the same for a ServiceMonitor's `honorLabels`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from controlplane import ROOT, ControlPlaneError, module_pin  # noqa: E402
from ports import free_port  # noqa: E402
from processes import spawn, stop_process, tail, wait_answering  # noqa: E402
from waiting import wait_for  # noqa: E402

GO_MODULE = ROOT / "tests" / "prometheus"
MODULE = "github.com/prometheus/prometheus"
SCRAPE_INTERVAL_S = 1


class PrometheusError(RuntimeError):
    """The API refused a request (a query that does not parse, a bad range, ...)."""


def prometheus_version() -> str:
    """The Prometheus module pinned in tests/prometheus/go.mod (e.g. 'v0.316.0')."""
    return module_pin(GO_MODULE, MODULE)


def prometheus_binary() -> Path:
    return ROOT / ".cache" / "prometheus" / prometheus_version() / "bin" / "prometheus"


def scrape_config(targets: dict[str, list[str]], interval_s: int = SCRAPE_INTERVAL_S,
                  labels: dict[str, str] | None = None, honor_labels: bool = False) -> dict:
    """The configuration file's content (JSON is YAML) for `targets`: job -> metrics URLs.
    One scrape job per (job, scheme, path), the URLs' host:port as static targets with
    `labels` as their target labels."""
    jobs = []
    for job, urls in targets.items():
        groups: dict[tuple[str, str], list[str]] = {}
        for url in urls:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"target {url!r} of job {job!r} is not an http(s) URL (http://HOST:PORT/metrics)")
            groups.setdefault((parts.scheme, parts.path or "/metrics"), []).append(parts.netloc)
        for (scheme, path), hosts in groups.items():
            jobs.append({"job_name": job, "scheme": scheme, "metrics_path": path, "honor_labels": honor_labels,
                         "static_configs": [{"targets": hosts, "labels": dict(labels or {})}]})
    if len({job["job_name"] for job in jobs}) != len(jobs):
        raise ValueError("a job's targets must share one scheme and path")
    return {"global": {"scrape_interval": f"{interval_s}s", "scrape_timeout": f"{interval_s}s",
                       "evaluation_interval": f"{interval_s}s"},
            "scrape_configs": jobs}


class Prometheus:
    """start() returns once /-/ready answers 200; stop() ends the process (SIGTERM, so the
    TSDB closes cleanly) and removes its storage."""

    def __init__(self, targets: dict[str, list[str]], workdir: Path | None = None,
                 interval_s: int = SCRAPE_INTERVAL_S, labels: dict[str, str] | None = None,
                 honor_labels: bool = False):
        self.targets = targets
        self.labels = labels
        self.honor_labels = honor_labels
        self.interval_s = interval_s
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="tpuft-prometheus-"))
        self.log = self.workdir / "prometheus.log"
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "Prometheus":
        binary = prometheus_binary()
        if not os.access(binary, os.X_OK):
            raise ControlPlaneError(f"Prometheus {prometheus_version()} is not built ({binary}): run `make prometheus` "
                                    "(`make test` runs it for you)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(json.dumps(scrape_config(self.targets, self.interval_s, self.labels, self.honor_labels),
                                      indent=2))
        storage = self.workdir / "data"
        self.port = free_port()
        self.proc = spawn([str(binary), f"--config.file={config}", f"--storage.tsdb.path={storage}",
                           f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"], self.log)
        try:
            wait_answering(self.proc, self._ready, "Prometheus", self.log, timeout, interval=0.2,
                           error=ControlPlaneError)
        except ControlPlaneError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace=10)
            self.proc = None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:  # not listening yet, or 503 while it starts
            return False

    def log_tail(self, n: int = 30) -> str:
        return tail(self.log, n)

    # -- the HTTP API

    def api(self, path: str, **params) -> object:
        """GET /api/v1/<path> with `params` (a list value repeats the parameter); the
        answer's `data`. PrometheusError (with the server's message) when it refuses."""
        query = urllib.parse.urlencode(
            [(k, v) for k, vs in params.items() if vs is not None for v in (vs if isinstance(vs, list) else [vs])])
        request = self.url + "/api/v1/" + path + ("?" + query if query else "")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as error:  # 400/422: the body says why
            try:
                body = json.loads(error.read())
            except ValueError:
                raise PrometheusError(f"GET {request}: HTTP {error.code}") from error
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query: the result's series (`metric` labels, `value` [t, "v"])."""
        data = self.api("query", query=expr, time=at)
        return _series(data)

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        """A range query: the result's series (`metric` labels, `values` [[t, "v"], ...])."""
        data = self.api("query_range", query=expr, start=start, end=end, step=step)
        return _series(data)

    def series(self, match: str, start: float | None = None, end: float | None = None) -> list[dict]:
        """The label sets of every series `match` selects in [start, end]."""
        return self.api("series", **{"match[]": [match], "start": start, "end": end})

    def label_values(self, label: str, match: str | None = None, start: float | None = None,
                     end: float | None = None) -> list[str]:
        return self.api(f"label/{urllib.parse.quote(label)}/values",
                        **{"match[]": [match] if match else None, "start": start, "end": end})

    def targets_health(self, job: str) -> list[dict]:
        """The active targets of `job` (`scrapeUrl`, `health`, `lastError`, ...)."""
        return [t for t in self.api("targets", state="active")["activeTargets"] if t["labels"].get("job") == job]

    def wait_up(self, job: str, timeout: float = 30.0) -> list[dict]:
        """Every target of `job` scraped successfully at least once (health 'up')."""
        def all_up():
            found = self.targets_health(job)
            return found if found and all(t["health"] == "up" for t in found) else None

        return wait_for(all_up, timeout, f"Prometheus scraping every target of job {job!r}",
                        details=lambda: f"targets: {self.targets_health(job)}\n{self.log_tail()}")

    def wait_scraped(self, timeout: float = 10.0) -> None:
        """Every target scraped again after now: what the targets serve at this moment is
        in the TSDB (two intervals, as a scrape may be under way)."""
        since = time.time()

        def scraped_since():
            found = [t for job in self.targets for t in self.targets_health(job)]
            return found and all(_unix(t.get("lastScrape")) > since + self.interval_s for t in found)

        wait_for(scraped_since, timeout, "a scrape of every target after now", interval=0.2)


def _series(data: dict) -> list[dict]:
    if data["resultType"] in ("scalar", "string"):  # one value, no labels
        return [{"metric": {}, "value": data["result"]}]
    return data["result"]


def _unix(rfc3339: str | None) -> float:
    """Prometheus' RFC 3339 timestamps (nanoseconds, 'Z' or an offset) as Unix seconds."""
    from datetime import datetime

    if not rfc3339 or rfc3339.startswith("0001-"):
        return 0.0
    text = rfc3339.replace("Z", "+00:00")
    head, _, rest = text.partition(".")
    if rest:  # Python takes at most microseconds
        digits = "".join(c for c in rest if c.isdigit())
        text = f"{head}.{digits[:6]}{rest[len(digits):]}"
    return datetime.fromisoformat(text).timestamp()
