"""The chart's values and notes without helm: values.schema.json accepts the shipped values
and refuses misspelt keys, the aggregated ClusterRoles are those of deploy/base, the notes
never send users to a sample with a placeholder image, and `kubectl apply -k deploy/` is the
base."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from manifests import CHART, DEPLOY, documents, load
from tpufinetune.settings import PREFIX, Settings

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES = load((CHART / "values.yaml").read_text())


def test_the_shipped_values_match_the_schema():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.validate(VALUES, SCHEMA)


def test_every_value_is_in_the_schema():
    def keys(values: dict, schema: dict, path: str = ""):
        for key, value in values.items():
            assert key in schema.get("properties", {}), f"{path}{key} is not in the schema"
            if isinstance(value, dict) and "properties" in schema["properties"][key]:
                yield from keys(value, schema["properties"][key], f"{path}{key}.")
            yield f"{path}{key}"

    assert "metrics.serviceMonitor.enabled" in set(keys(VALUES, SCHEMA))


@pytest.mark.parametrize("change,refusal", [
    ({"serviceAcount": {"create": False}},                  # misspelt key
     "Additional properties are not allowed ('serviceAcount' was unexpected)"),
    ({"metrics": {"serviceMonitor": {"enabled": "yes"}}},   # wrong type
     "'yes' is not of type 'boolean'"),
    ({"settings": {"pollInterval": 0}},                     # the operator would refuse it
     "0 is less than or equal to the minimum of 0"),
    ({"image": {"pullPolicy": "Sometimes"}}, "'Sometimes' is not one of"),
])
def test_the_schema_refuses_bad_values(change, refusal):
    values = json.loads(json.dumps(VALUES))
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    with pytest.raises(jsonschema.ValidationError) as caught:
        jsonschema.validate(values, SCHEMA)
    assert caught.value.message.startswith(refusal), caught.value.message


def test_kubectl_apply_k_deploy_is_the_base():
    kustomization = load((DEPLOY / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["base"]
    assert set(kustomization) == {"apiVersion", "kind", "resources"}


def test_aggregated_roles_give_edit_and_view_users_the_runs():
    roles = {r["metadata"]["name"]: r for r in
             documents((DEPLOY / "base" / "clusterrole-aggregated.yaml").read_text())}
    edit, view = roles["tpufinetune-edit"], roles["tpufinetune-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {"create", "delete", "patch", "update"} <= set(edit["rules"][0]["verbs"])
    assert set(view["rules"][0]["verbs"]) == {"get", "list", "watch"}
    # Status is the operator's: nobody but the operator writes it.
    for role in roles.values():
        for rule in role["rules"]:
            if "tpufinetunes/status" in rule["resources"]:
                assert set(rule["verbs"]) <= {"get", "list", "watch"}
    assert "clusterrole-aggregated.yaml" in load(
        (DEPLOY / "base" / "kustomization.yaml").read_text())["resources"]


def test_notes_point_at_no_sample_with_a_placeholder_image():
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "PROJECT" not in notes
    assert "kubectl apply -f deploy/samples" not in notes
    assert "helm show crds" in notes  # Helm never upgrades CRDs: the notes say how


# Set elsewhere than the settings ConfigMap: the namespace from the downward API, and a fixed
# head's token (only with a fixed dashboard URL) from a Secret.
NOT_IN_THE_CONFIGMAP = {"operator_namespace", "ray_token"}
# Shipped otherwise than the operator's default, on purpose: the installs watch one
# namespace (the operator alone watches every namespace).
SHIPPED_OTHERWISE = {"namespace": "ml-team"}


def chart_setting(template: str, variable: str) -> str | None:
    """The value the chart's configmap template gives `variable` with the shipped values
    (None for templating other than a value or a joined list)."""
    value = next(line for line in template.splitlines() if line.startswith(f"  {variable}: ")).split(": ", 1)[1]
    if found := re.fullmatch(r'\{\{ \.Values\.settings\.(\w+) \| quote \}\}', value):
        return str(VALUES["settings"][found[1]])
    if found := re.fullmatch(r'\{\{ join " " \.Values\.settings\.(\w+) \| quote \}\}', value):
        return " ".join(VALUES["settings"][found[1]])
    return None if "{{" in value else value.strip('"')


def test_every_operator_setting_is_shipped_with_its_default_in_both_configmaps():
    """A setting added to the operator (a new bound, say) reaches users only if kustomize's
    ConfigMap and the chart's template carry it; the kustomize one with the operator's own
    default, so the two sources of a default cannot drift apart."""
    base = next(d for d in documents((DEPLOY / "base" / "configmap.yaml").read_text()) if d["kind"] == "ConfigMap")
    template = (CHART / "templates" / "configmap.yaml").read_text()
    for name, field in Settings.model_fields.items():
        if name in NOT_IN_THE_CONFIGMAP:
            continue
        variable = PREFIX + name.upper()
        assert variable in base["data"], f"{variable} is not in deploy/base/configmap.yaml"
        assert f"  {variable}: " in template, f"{variable} is not in the chart's configmap template"
        default = field.default
        shipped = base["data"][variable]
        if isinstance(default, bool):
            assert shipped == str(default).lower(), (variable, shipped, default)
        elif isinstance(default, (int, float)):
            assert float(shipped) == float(default), (variable, shipped, default)
        else:  # a string: the same in kustomize's ConfigMap and the chart's
            assert shipped == SHIPPED_OTHERWISE.get(name, default), (variable, shipped, default)
            assert chart_setting(template, variable) in (shipped, None), (variable, chart_setting(template, variable))


def test_the_shipped_namespaces_are_what_the_operator_watches():
    """deploy/base watches one namespace (its caches watch there only, as its RBAC allows);
    the several-namespaces overlay a name and a glob (its caches watch cluster-wide, which
    that overlay's ClusterRole reads)."""
    def watched(path) -> Settings:
        data = next(d for d in documents(path.read_text()) if d["kind"] == "ConfigMap")["data"]
        return Settings.from_env({"TPUFT_NAMESPACE": data["TPUFT_NAMESPACE"]})

    base = watched(DEPLOY / "base" / "configmap.yaml")
    assert base.namespaces == ["ml-team"] and base.one_namespace == "ml-team"
    several = watched(DEPLOY / "overlays" / "several-namespaces" / "configmap.yaml")
    assert several.namespaces == ["ml-team", "team-*"] and several.one_namespace == ""
    assert Settings.from_env({"TPUFT_NAMESPACE": "team-*"}).one_namespace == ""
    assert Settings.from_env({"TPUFT_NAMESPACE": " a, b "}).namespaces == ["a", "b"]
    assert Settings().namespaces == [] and Settings().one_namespace == ""
