"""`tpufinetune operator`: start the kopf operator with the handlers in handlers.py.

Liveness: kopf serves `GET /healthz` on --liveness (default http://0.0.0.0:8080/healthz);
it fails once a run's status could not be written for TPUFT_STALL_TIMEOUT (handlers.py).
Metrics: Prometheus text on --metrics-port (or $TPUFT_METRICS_PORT; 0, the default, is off);
see metrics.py.
Peering: off by default (`--standalone`); run one replica, or pass --peering NAME with the
kopf peering CRD installed to run several with one active.
"""
from __future__ import annotations

import argparse
import asyncio
import logging


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


def operator_settings():
    """kopf's settings before the startup handler adds the rest: Events name the operator,
    not the framework (`kubectl describe` shows it in the From column)."""
    import socket

    import kopf

    settings = kopf.OperatorSettings()
    settings.posting.reporting_component = REPORTING_COMPONENT
    settings.posting.reporting_instance = socket.gethostname()  # the pod's name
    return settings


def run(args: argparse.Namespace) -> int:
    import os

    import kopf

    from tpufinetune.adapters import handlers  # noqa: F401  (registers the handlers)

    namespaces = args.namespace or ([os.environ["TPUFT_NAMESPACE"]] if os.environ.get("TPUFT_NAMESPACE") else [])
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
    asyncio.run(kopf.operator(
        settings=operator_settings(),
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=not args.peering,
        peering_name=args.peering or None,
        liveness_endpoint=args.liveness or None,
    ))
    return 0
