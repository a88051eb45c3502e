"""Kubernetes resource quantities: the accepted syntax and exact comparison."""
from __future__ import annotations

import re
from decimal import Decimal

# The apiserver's own pattern for resource.Quantity (k8s.io/apimachinery), so a value the
# CRD schema accepts is also one the pods accept.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)
_SUFFIX = re.compile(r"^([+-]?[0-9.]+)([a-zA-Z]*)$")

_MULTIPLIERS = {
    "": Decimal(1),
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"),
    "T": Decimal("1e12"), "P": Decimal("1e15"), "E": Decimal("1e18"),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30),
    "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}


def normalize_quantity(value: object) -> str:
    """A quantity as the string Kubernetes stores; YAML numbers (`cpu: 4`) are accepted."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 4, 500m, 16Gi)")
    text = str(value)
    if not _QUANTITY_RE.match(text):
        raise ValueError(f'"{text}" is not a Kubernetes quantity (e.g. 4, 500m, 16Gi)')
    return text


def parse_quantity(text: str) -> Decimal:
    """The exact value of a valid quantity (`16Gi` -> 17179869184, `500m` -> 0.5)."""
    match = _SUFFIX.match(text)
    if match and match.group(2) in _MULTIPLIERS:
        return Decimal(match.group(1)) * _MULTIPLIERS[match.group(2)]
    return Decimal(text)  # decimal exponent form, e.g. 1e3
