"""Thin adapters between the core and the outside: kopf handlers, the Kubernetes API,
the Ray Job API and Prometheus metrics."""
