"""The bind shim (podbind.c), built once per source with this machine's C compiler.

`library()` returns the shared object, or None where no C compiler is found: then a pod's
wildcard bind is the machine's (two pods on one fixed port collide) and the node agent logs
it once."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "podbind.c"
CACHE = HERE.parents[1] / ".cache" / "ground"


def library() -> Path | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    target = CACHE / f"podbind-{digest}.so"
    if target.exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}")
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SOURCE), "-ldl"],
                   check=True, capture_output=True)
    partial.replace(target)  # atomic: two grounds building at once both end with one file
    return target
