"""`tpufinetune render`: what the operator would create for a TPUFineTune, without a cluster.

stdout holds Kubernetes documents only (`tpufinetune render FILE | kubectl apply -f -`);
the Ray job submission is a comment under each RayCluster, or the whole output with
`--jobs`.

Validation is `parse_spec`, the operator's own, so a spec that renders is one the operator
accepts; documents are rendered only after every input document validated. The memory
plan (core/memplan.py) is a comment under each header, and a run that cannot fit its slice
is refused as the operator would fail it (DoesNotFit), offline: known models are a table.

Every comment goes through `comment`: a user's string (a model id, a namespace) is printed
with its control characters escaped, so no text of the spec's becomes a line of YAML.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import asdict

import yaml

from .api import API_VERSION, DNS_SUBDOMAIN, INIT_FROM_SELF_MESSAGE, KIND, TPUFineTuneSpec, parse_spec
from .errors import SpecError
from .jobspec import job_submission
from . import initsource
from .memplan import estimate, refuses
from .podtemplate import raycluster_with_pod_settings

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
FIRST_ATTEMPT = 1
_DNS_SUBDOMAIN = re.compile(DNS_SUBDOMAIN)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a namespace's name


class RenderError(Exception):
    """An input that cannot be rendered; the message is one line for stderr."""


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:
        return True


def _dump(document: dict) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=100)


def load_documents(text: str, source: str) -> list[dict]:
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise RenderError(f"{source}: not valid YAML{where}") from None
    if not documents:
        raise RenderError(f"{source}: no YAML documents")
    return documents


def _check_document(document: object, index: int, source: str) -> tuple[str, str, str, object]:
    where = f"{source}: document {index + 1}"
    if not isinstance(document, dict):
        raise RenderError(f"{where}: not a mapping")
    if (document.get("apiVersion"), document.get("kind")) != (API_VERSION, KIND):
        raise RenderError(f"{where}: expected apiVersion {API_VERSION}, kind {KIND}; got "
                          f"{document.get('apiVersion')}, {document.get('kind')}")
    metadata = document.get("metadata") or {}
    name = metadata.get("name") if isinstance(metadata, dict) else None
    if not isinstance(name, str) or not _DNS_SUBDOMAIN.match(name) or len(name) > 253:
        raise RenderError(f"{where}: metadata.name: must be a DNS subdomain name, got {name!r}")
    namespace = metadata.get("namespace") or "default"
    if not isinstance(namespace, str) or not _DNS_LABEL.match(namespace) or len(namespace) > 63:
        raise RenderError(f"{where}: metadata.namespace: must be a DNS label name (lowercase letters, "
                          f"digits and '-', at most 63), got {namespace!r}")
    uid = str(metadata.get("uid") or "")
    return name, namespace, uid, document.get("spec")


def render(documents: list[dict], source: str, jobs: bool = False) -> str:
    """The YAML stream for `documents`: per TPUFineTune, its RayCluster with the Ray job
    the operator would submit as a comment, so the stream can go to `kubectl apply -f -`.
    With `jobs`, only the job submissions, as YAML documents."""
    validated = []
    for index, document in enumerate(documents):
        name, namespace, uid, raw_spec = _check_document(document, index, source)
        try:
            spec = parse_spec(raw_spec if raw_spec is not None else {})
        except SpecError as exc:
            raise RenderError(f'{source}: TPUFineTune "{name}": {exc}') from None
        if spec.model.init_from is not None and spec.model.init_from.run == name:
            raise RenderError(f'{source}: TPUFineTune "{name}": spec.model.initFrom.run: {INIT_FROM_SELF_MESSAGE}')
        validated.append((name, namespace, uid, spec))
    sources = {name: spec for name, _, _, spec in validated}  # a chained run's source may be in the same file
    for name, namespace, uid, spec in validated:
        memory = _plan(spec, sources)
        if memory is not None and refuses(memory):
            # What the operator would do: fail the run (DoesNotFit) before any RayCluster.
            raise RenderError(f'{source}: TPUFineTune "{name}": does not fit: {memory.refusal()}')

    out = []
    for name, namespace, uid, spec in validated:
        header = f"TPUFineTune {namespace}/{name}"
        memory = _plan(spec, sources)
        planned = comment(f"{header}: memory plan: {memory.summary()}") if memory is not None else ""
        if memory is None and spec.model.init_from is not None:
            planned = comment(f"{header}: memory plan: made for TPUFineTune {spec.model.init_from.run}'s base "
                              "model once it has Succeeded (it is not in this file)")
        job = _job_document(name, namespace, uid or PLACEHOLDER_UID, spec, initsource.preview(spec, sources))
        if jobs:
            out.append("---\n" + comment(f"{header}: the Ray job the operator submits (attempt "
                                          f"{FIRST_ATTEMPT}).") + planned + _dump(job))
            continue
        cluster = raycluster_with_pod_settings(name, namespace, uid or PLACEHOLDER_UID, spec)
        note = ""
        if not uid:
            # A placeholder owner would have the garbage collector delete the RayCluster
            # as soon as it is applied; without metadata.uid it is applied unowned.
            del cluster["metadata"]["ownerReferences"]
            note = comment("metadata.uid is absent: no ownerReferences (the operator sets the "
                           f"resource's own); job ids use the placeholder {PLACEHOLDER_UID}.")
        out.append("---\n" + comment(f"{header}: the RayCluster the operator creates.") + planned + note
                   + _dump(cluster)
                   + comment(f"{header}: the Ray job the operator submits once it is ready "
                             f"(attempt {FIRST_ATTEMPT}; --jobs prints it as YAML):")
                   + comment(_dump(job), indent="#   "))
    return "".join(out)


def _plan(spec: TPUFineTuneSpec, sources: dict):
    """The memory plan the operator makes; a chained run's for its source's base model."""
    request = initsource.memory_request(spec, initsource.preview(spec, sources))
    return estimate(request) if request is not None else None


def _job_document(name: str, namespace: str, uid: str, spec: TPUFineTuneSpec, init_from: dict | None = None) -> dict:
    job = asdict(job_submission(name, namespace, uid, spec, FIRST_ATTEMPT, init_from=init_from))
    return {"rayJobSubmission": {
        "submissionId": job["submission_id"],
        "submissionIdScheme": "tft-<metadata.uid>-<attempt>, attempt 1, 2, ... "
                              f"(up to 1 + spec.maxRetries = {1 + spec.max_retries})",
        "entrypointArgv": job["entrypoint_argv"],
        "entrypoint": job["entrypoint"],
        "runtimeEnv": job["runtime_env"],
        "metadata": job["metadata"],
    }}


def comment(text: str, indent: str = "# ") -> str:
    """`text` as YAML comment lines: each of its lines (str.splitlines, which breaks at
    every character YAML takes for a line break, and more) after `indent`, with any control
    character left in a line escaped, so nothing in `text` can end the comment."""
    return "".join(f"{indent}{_escaped(line)}\n" for line in text.splitlines())


def _escaped(line: str) -> str:
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in ("Cc", "Zl", "Zp")
                   else c for c in line)
