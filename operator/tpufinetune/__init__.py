"""TPUFineTune: a Kubernetes operator that runs LLM fine-tuning on Cloud TPU slices.

The pure core (no Kubernetes or Ray I/O): `api` (models, `parse_spec`), `generations`
(TPU facts), `sizing` (`render_raycluster`), `jobspec` (`job_submission`), `crdgen`.
"""

__version__ = "0.1.0"  # the one place: pyproject.toml reads it
