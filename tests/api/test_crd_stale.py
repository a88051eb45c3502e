"""crds/ is generated from the pydantic models and must never drift from them; the
generated schema must be structural, described everywhere and cheap for CEL."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tpufinetune import crdgen
from tpufinetune.core.generations import GENERATIONS

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / crdgen.CRD_FILENAME


@pytest.fixture(scope="module")
def crd() -> dict:
    return crdgen.crd()


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _walk(schema[key], f"{path}[]")


def test_crds_directory_is_up_to_date():
    assert CRD_PATH.exists(), "run `make crds`"
    assert CRD_PATH.read_text() == crdgen.crd_yaml(), (
        "crds/ is stale: run `make crds` (python -m tpufinetune.crdgen --out crds/)")


def test_crdgen_writes_the_file(tmp_path):
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / "tpufinetunes.tpufinetune.dev.yaml").read_text() == crdgen.crd_yaml()


def test_names_scope_and_subresources(crd):
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "tpufinetunes.tpufinetune.dev"
    assert spec["group"] == "tpufinetune.dev" and spec["scope"] == "Namespaced"
    assert spec["names"] == {"kind": "TPUFineTune", "listKind": "TPUFineTuneList",
                             "plural": "tpufinetunes", "singular": "tpufinetune",
                             "shortNames": ["tft", "tpuft"],
                             "categories": ["all", "tpufinetune"]}
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns(crd):
    columns = {c["name"]: c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert list(columns) == ["Generation", "Topology", "Mode", "Phase", "Epoch", "Progress", "Loss",
                             "Tokens/s", "Age", "Checkpoint", "Attempts", "Chip-hours", "First step (s)",
                             "Message"]
    assert columns["Epoch"]["jsonPath"] == ".status.epochProgress"
    assert columns["Progress"]["jsonPath"] == ".status.progress.summary"
    assert columns["Message"]["jsonPath"] == ".status.message"
    assert columns["Attempts"]["jsonPath"] == ".status.attempt"
    assert columns["Chip-hours"]["jsonPath"] == ".status.usage.chipHours"
    # The current (latest) attempt's time to first step.
    assert columns["First step (s)"]["jsonPath"] == ".status.attempts[-1:].startup.firstStepSeconds"
    wide = {"Checkpoint", "Attempts", "Chip-hours", "First step (s)", "Message"}
    assert all(columns[n]["priority"] == 1 for n in wide)
    assert all("priority" not in c for n, c in columns.items() if n not in wide)


def test_schema_is_structural_and_described(crd):
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert not {"$ref", "$defs", "title", "const", "allOf", "oneOf"} & node.keys(), path
        assert node.get("type") != "null", path
        if "properties" in node:
            assert "additionalProperties" not in node, path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, path
        else:
            assert "type" in node, path
        if path.startswith((".spec", ".status")) and not path.endswith("[]"):
            assert node.get("description"), f"{path} has no description (kubectl explain)"


def test_cel_inputs_are_bounded(crd):
    """The apiserver estimates CEL cost from maxLength/maxItems: bound every string, list
    and map under spec so the rules stay far below the per-CRD cost limit."""
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for path, node in _walk(spec):
        if node.get("type") == "string" and "enum" not in node:
            assert "maxLength" in node, path
        if node.get("type") == "array":
            assert "maxItems" in node, path
        if isinstance(node.get("additionalProperties"), dict):
            assert "maxProperties" in node, path


def test_defaults_live_in_the_schema(crd):
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = spec["properties"]
    assert props["mode"]["default"] == "finetune"
    assert props["tpu"]["properties"]["slices"]["default"] == 1
    assert props["model"]["default"] == {}
    assert props["model"]["properties"]["id"]["default"] == "google/gemma-4-E2B-it"
    assert props["training"]["properties"]["epochs"]["default"] == 3
    assert props["checkpoint"]["properties"]["keep"]["default"] == 1
    assert spec["required"] == ["tpu", "image"]


def test_cel_rules_come_from_the_generation_table(crd):
    tpu = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["tpu"]
    rules = "\n".join(r["rule"] for r in tpu["x-kubernetes-validations"])
    for gen in GENERATIONS:
        for topology in gen.valid_topologies():
            assert f"'{topology}'" in rules or not gen.is_tpu


def test_status_declares_every_field_the_operator_writes(crd):
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert set(status["properties"]) >= {
        "phase", "conditions", "observedGeneration", "rayClusterName", "jobId", "dashboardURL",
        "attempt", "epoch", "epochs", "epochProgress", "loss", "evalLoss", "tokensPerSecond",
        "epochTimeSeconds", "history", "checkpointURI", "exportedModelURI", "startTime",
        "completionTime", "message", "logCursor", "collectives"}
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["properties"]) == {
        "type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}


def test_generated_file_is_plain_yaml():
    text = CRD_PATH.read_text()
    assert "&id" not in text and "*id" not in text
    assert yaml.safe_load(text)["kind"] == "CustomResourceDefinition"


def test_cel_message_expressions_only_concatenate_bounded_strings(crd):
    """`string(<int>)` has no size bound for the apiserver's cost estimator, which then
    refuses the whole CRD; messages index literal lists instead."""
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        for rule in node.get("x-kubernetes-validations", []):
            assert "string(" not in rule.get("messageExpression", ""), path
