"""CEL's literals, for the modules that write CRD validation rules."""
from __future__ import annotations


def cel_string(text: str) -> str:
    """`text` as a single-quoted CEL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
