"""Operator settings from TPUFT_* variables: one pydantic model, errors naming the variable;
kopf's Events name the operator."""
from __future__ import annotations

import pytest

from tpufinetune.serve import REPORTING_COMPONENT, operator_settings
from tpufinetune.settings import DEFAULT_DASHBOARD_URL, Settings, SettingsError


def test_no_variables_give_the_documented_defaults():
    settings = Settings.from_env({})
    assert settings == Settings()
    assert (settings.dashboard_url, settings.poll_interval, settings.provision_timeout,
            settings.namespace, settings.ray_headers()) == (DEFAULT_DASHBOARD_URL, 5.0,
                                                            1800.0, "", {})


def test_every_field_is_read_from_its_variable(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    settings = Settings.from_env({
        "TPUFT_DASHBOARD_URL": "http://{service}:8265", "TPUFT_POLL_INTERVAL": "2.5",
        "TPUFT_PROVISION_TIMEOUT": "60", "TPUFT_SUBMIT_TIMEOUT": "45", "TPUFT_NAMESPACE": "ml",
        "TPUFT_RAY_TOKEN_FILE": str(token)})
    assert settings.poll_interval == 2.5 and settings.provision_timeout == 60 and settings.submit_timeout == 45
    assert settings.namespace == "ml"
    assert settings.dashboard_for(cluster="c", namespace="n", service="s") == "http://s:8265"
    assert settings.ray_headers() == {"Authorization": "Bearer s3cret"}
    assert "s3cret" not in repr(settings)


@pytest.mark.parametrize("env,expected", [
    ({"TPUFT_POLL_INTERVAL": "5s"},
     "TPUFT_POLL_INTERVAL='5s' is not a number of seconds; write a plain number, e.g. 5"),
    ({"TPUFT_PROVISION_TIMEOUT": "30m"}, "TPUFT_PROVISION_TIMEOUT='30m' is not a number"),
    ({"TPUFT_SUBMIT_TIMEOUT": "0"}, "TPUFT_SUBMIT_TIMEOUT='0': input should be greater than 0"),
    ({"TPUFT_POLL_INTERVAL": "0"}, "TPUFT_POLL_INTERVAL='0': input should be greater than 0"),
    ({"TPUFT_RAY_THREADS": "many"}, "TPUFT_RAY_THREADS='many' is not a whole number"),
    ({"TPUFT_KUBE_THREADS": "0"}, "TPUFT_KUBE_THREADS='0': input should be greater than or equal to 1"),
    ({"TPUFT_RAY_TOKEN_FILE": "/nonexistent/token"},
     "TPUFT_RAY_TOKEN_FILE: cannot read /nonexistent/token"),
])
def test_a_bad_variable_is_named_with_the_fix(env, expected):
    with pytest.raises(SettingsError) as caught:
        Settings.from_env(env)
    assert str(caught.value).startswith(expected)


def test_settings_cannot_change_after_start():
    with pytest.raises(ValueError, match=r"poll_interval\n  Instance is frozen"):
        Settings().poll_interval = 1  # type: ignore[misc]


def test_events_are_reported_as_the_operator():
    settings = operator_settings()
    assert settings.posting.reporting_component == REPORTING_COMPONENT == "tpufinetune-operator"
    assert settings.posting.reporting_instance
