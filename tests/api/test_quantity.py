"""quantity.parse_quantity is the core's own (the core may not import the kubernetes
client: `pip install tpufinetune` has pydantic and PyYAML only); it must agree with
kubernetes.utils.parse_quantity on every form the CRD's pattern admits."""
from __future__ import annotations

import re

import pytest
from kubernetes.utils import parse_quantity as kubernetes_parse_quantity

from tpufinetune.core.quantity import QUANTITY_PATTERN, normalize_quantity, parse_quantity

SAMPLES = ["0", "1", "4", "64", "500m", "1.5", "0.25", ".5", "100Gi", "16Gi", "200Gi", "1Ki",
           "3Mi", "7Ti", "1Pi", "2Ei", "1k", "5M", "9G", "1T", "1P", "1E", "250n", "4u",
           "1e3", "2E6", "1.5e-3", "+3", "12.5Mi", "0.5Gi"]


@pytest.mark.parametrize("text", SAMPLES)
def test_agrees_with_the_kubernetes_client(text):
    assert re.match(QUANTITY_PATTERN, text)
    assert parse_quantity(text) == kubernetes_parse_quantity(text)


@pytest.mark.parametrize("value", ["lots", "1.5.2", "Gi", "10gb", True, None, [1]])
def test_refuses_what_is_not_a_quantity(value):
    with pytest.raises(ValueError, match="is not a Kubernetes quantity"):
        normalize_quantity(value)


def test_yaml_numbers_become_quantity_strings():
    assert normalize_quantity(32) == "32" and normalize_quantity(0.5) == "0.5"
