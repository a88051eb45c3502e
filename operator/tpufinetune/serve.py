"""`tpufinetune operator`: start the kopf operator with the handlers in handlers.py.

Liveness: kopf serves `GET /healthz` on --liveness (default http://0.0.0.0:8080/healthz);
it fails once a run's status could not be written for TPUFT_STALL_TIMEOUT (handlers.py).
Metrics: Prometheus text on --metrics-port (or $TPUFT_METRICS_PORT; 0, the default, is off);
see metrics.py.
Leader election (TPUFT_LEADER_ELECTION, on by default; adapters/lease.py): the process
first waits for a coordination.k8s.io Lease and starts kopf only once it holds it, so any
number of replicas run with exactly one acting. A standby answers /healthz (it is healthy)
and /metrics while it waits. A leader that cannot renew within TPUFT_RENEW_DEADLINE exits
at once with EXIT_LOST_LEASE; one stopped by SIGTERM releases the Lease, so a standby
takes over within a retry period (a rolling update).
kopf's own peering (--peering) is not leader election and stays off by default.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all (or $TPUFT_NAMESPACE)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="liveness endpoint URL; empty to disable")
    parser.add_argument("--peering", default="", help="kopf peering name; empty runs standalone")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics on this port (default $TPUFT_METRICS_PORT, or off)")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.add_argument("--json-logs", action="store_true", help="log JSON lines")


REPORTING_COMPONENT = "tpufinetune-operator"
EXIT_LOST_LEASE = 3  # the leader could not renew its Lease: stopped at once


def operator_settings():
    """kopf's settings before the startup handler adds the rest: Events name the operator,
    not the framework (`kubectl describe` shows it in the From column)."""
    import socket

    import kopf

    settings = kopf.OperatorSettings()
    settings.posting.reporting_component = REPORTING_COMPONENT
    settings.posting.reporting_instance = socket.gethostname()  # the pod's name
    return settings


def _lost_lease(why: str) -> None:
    """Stop acting at once: no handler, daemon or status write runs after this line.
    Kubernetes restarts the container, and it comes back as a standby."""
    import os

    logging.getLogger(__name__).critical("lost the leadership: %s; exiting", why)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_LOST_LEASE)


def _standby_health(liveness: str):
    """While waiting for the Lease, answer the liveness URL (200, {"leader": false}): a
    standby is healthy. kopf serves it once this process leads. None when disabled."""
    import json
    import threading
    import urllib.parse
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    if not liveness:
        return None
    url = urllib.parse.urlsplit(liveness)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path.split("?")[0] == url.path
            body = json.dumps({"leader": False} if found else {"error": "not found"}).encode()
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((url.hostname or "localhost", url.port or 80), Health)
    threading.Thread(target=server.serve_forever, name="standby-health", daemon=True).start()
    return server


def _elect(settings):
    """Block until this process holds the Lease; renew it in the background from then on.
    Returns the elector (stop it to release the Lease), or None when election is off."""
    if not settings.leader_election:
        return None
    from tpufinetune.adapters import lease
    from tpufinetune.adapters.handlers import _load_kube_config

    elector = lease.LeaseElector(
        _load_kube_config(), settings.operator_namespace, settings.lease_name,
        lease.identity(), lease_duration=settings.lease_duration, renew_deadline=settings.renew_deadline,
        retry_period=settings.retry_period, on_lost=_lost_lease)
    elector.acquire()
    elector.start_renewing()
    return elector


def run(args: argparse.Namespace) -> int:
    import os

    import kopf

    from tpufinetune.adapters import handlers  # noqa: F401  (registers the handlers)
    from tpufinetune.adapters import memory

    memory.bound_arenas()  # before any worker thread allocates
    from tpufinetune.settings import Settings, SettingsError

    namespaces = args.namespace or os.environ.get("TPUFT_NAMESPACE", "").replace(",", " ").split()
    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.json_logs else kopf.LogFormat.FULL,
    )
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    # kopf logs each liveness probe's success at INFO (every few seconds), and a failing
    # probe as one error line; aiohttp would add the same failure's traceback to each 500.
    logging.getLogger("kopf.activities.probe").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    metrics_port = args.metrics_port if args.metrics_port is not None else int(os.environ.get("TPUFT_METRICS_PORT") or 0)
    if metrics_port:
        from tpufinetune.adapters import metrics

        metrics.serve(metrics_port)
    try:
        settings = Settings.from_env()
        standby = _standby_health(args.liveness)
        try:
            elector = _elect(settings)
        finally:
            if standby is not None:
                standby.shutdown()
                standby.server_close()
    except SettingsError as error:
        print(f"tpufinetune operator: {error}", file=sys.stderr)
        return 2
    try:
        asyncio.run(kopf.operator(
            settings=operator_settings(),
            clusterwide=not namespaces,
            namespaces=namespaces,
            standalone=not args.peering,
            peering_name=args.peering or None,
            liveness_endpoint=args.liveness or None,
            # sizes kopf's connections (handlers.login): a stream per namespace, a glob's up to 64
            memo=kopf.Memo(watched_namespaces=sum(64 if set(n) & set("*?[") else 1 for n in namespaces)),
        ))
    finally:
        if elector is not None:
            elector.stop(release=True)
    return 0
