"""Generate the TPUFineTune CRD from the pydantic models (`make crds`).

Usage: `python -m tpufinetune.crdgen --out crds/`.

Pydantic's JSON Schema is rewritten into a Kubernetes structural schema: references
inlined, optional (`X | None`) collapsed to `X`, titles and `additionalProperties: false`
dropped (the apiserver's pruning and kubectl's strict field validation refuse unknown
fields instead), JSON Schema 2020 exclusive bounds turned into OpenAPI 3.0 booleans.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from .core.api import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION, TPUFineTuneSpec, schema_rules
from .core.celrules import cel_string, object_rules
from .core.status import TPUFineTuneStatus

CRD_FILENAME = f"{PLURAL}.{GROUP}.yaml"

PRINTER_COLUMNS = [
    {"name": "Generation", "type": "string", "jsonPath": ".spec.tpu.generation"},
    {"name": "Topology", "type": "string", "jsonPath": ".spec.tpu.topology"},
    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Epoch", "type": "string", "jsonPath": ".status.epochProgress"},
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress.summary"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.loss"},
    {"name": "Tokens/s", "type": "number", "jsonPath": ".status.tokensPerSecond"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Checkpoint", "type": "string", "jsonPath": ".status.checkpointURI",
     "priority": 1},
    # Attempts so far (status.attempts says why each ended and what it cost).
    {"name": "Attempts", "type": "integer", "jsonPath": ".status.attempt", "priority": 1},
    {"name": "Chip-hours", "type": "number", "jsonPath": ".status.usage.chipHours", "priority": 1},
    # The latest attempt's seconds from its start to its first optimizer step (empty until then).
    {"name": "First step (s)", "type": "number", "jsonPath": ".status.attempts[-1:].startup.firstStepSeconds",
     "priority": 1},
    # Why a run waits or failed (e.g. "waiting for RayCluster ... to be ready").
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
]
# `kubectl get all` (and `kubectl get tpufinetune`) list the runs with the other
# workloads, as KubeRay's RayClusters and RayJobs are.
CATEGORIES = ["all", "tpufinetune"]

_DROPPED_KEYS = {"title", "$defs"}


def _key_rules(node: dict) -> dict:
    """A map with constrained keys: pydantic writes patternProperties and propertyNames,
    which structural schemas lack, so the key checks become a CEL rule."""
    (pattern, value), = node.pop("patternProperties").items()
    names = node.pop("propertyNames", {})
    limit = names.get("maxLength")
    check = f"k.matches({cel_string(pattern)})"
    if limit:
        check = f"k.size() <= {limit} && {check}"
    node["additionalProperties"] = value
    node.setdefault("x-kubernetes-validations", []).append({
        "rule": f"self.all(k, {check})",
        "message": "keys must be Kubernetes label keys: an optional DNS subdomain prefix "
                   "and '/', then a name of letters, digits, '-', '_' and '.'"
                   + (f" ({limit} characters at most)" if limit else ""),
        "reason": "FieldValueInvalid",
    })
    return node


def _structural(node: dict, defs: dict) -> dict:
    if "patternProperties" in node:
        node = _key_rules(dict(node))
    if "$ref" in node:
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        node = {**defs[node["$ref"].split("/")[-1]], **siblings}
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        node = {k: v for k, v in node.items() if k != "anyOf"}
        if len(branches) == 1:
            # Optional[X]: the field's own keys (description, default) win over X's.
            return _structural({**branches[0], **node}, defs)
        node["anyOf"] = branches
    out: dict = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS or (key == "default" and value is None):
            continue
        if key == "additionalProperties" and value is False:
            continue
        if key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "const":
            out["enum"] = [value]
        elif key == "properties":
            out[key] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    return out


def model_schema(model: type, rules: dict | None = None) -> dict:
    """`model`'s structural schema; `rules` (model -> its CEL rules, api.schema_rules) go
    into the schema of each model they name, wherever it is used."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    defs = schema.get("$defs", {})
    for ruled, make in (rules or {}).items():
        node = schema if ruled is model else defs.get(ruled.__name__)
        if node is None:
            raise ValueError(f"{ruled.__name__} carries CEL rules but is not part of {model.__name__}'s schema")
        node["x-kubernetes-validations"] = [dict(sorted(rule.items())) for rule in make()]  # as pydantic writes them
    return _structural(schema, defs)


def openapi_schema() -> dict:
    spec = model_schema(TPUFineTuneSpec, schema_rules())
    spec.pop("description", None)  # the class's docstring: the CRD's own words, below, go last
    spec["description"] = ("Desired fine-tuning run: the TPU slice, the trainer image, "
                           "the model, data and hyperparameters.")
    status = model_schema(TPUFineTuneStatus)
    status["description"] = "Observed state, written by the operator only."
    # kopf keeps handler progress here when configured to; keep it from being pruned.
    status["properties"]["kopf"] = {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True,
        "description": "Operator framework bookkeeping (internal)."}
    return {
        "type": "object",
        "x-kubernetes-validations": [dict(sorted(rule.items())) for rule in object_rules()],
        "description": "TPUFineTune runs LLM fine-tuning (or an interconnect check) on a "
                       "Cloud TPU slice through a KubeRay RayCluster and the Ray Job API.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "API version of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def crd() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                      "singular": SINGULAR, "shortNames": list(SHORT_NAMES),
                      "categories": list(CATEGORIES)},
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": openapi_schema()},
            }],
        },
    }


class _NoAliasDumper(yaml.SafeDumper):
    """Writes repeated sub-schemas out in full: anchors (&id001) are legal YAML but make
    the CRD hard to read and review."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def crd_yaml() -> str:
    header = ("# Generated by `make crds` (python -m tpufinetune.crdgen) from tpufinetune/core/api.py "
              "(the models and their CEL rules).\n")
    return header + yaml.dump(crd(), Dumper=_NoAliasDumper, sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpufinetune.crdgen",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write into")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / CRD_FILENAME
    path.write_text(crd_yaml())
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
