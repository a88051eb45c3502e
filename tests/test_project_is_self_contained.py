"""The project carries everything its two commands need: no file may reach for the team's
shared folder beside the clone (a user's clone has none)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A relative path up and into it, or a pathlib join from a parent: the ways of naming the
# folder beside the clone. Built from parts so this file never matches itself.
OUTSIDE = re.compile("|".join([
    re.escape("..") + r"[/\\]" + "shared",
    r"parents?(\[\d+\])?\s*/\s*[\"']" + "shared" + "[\"']",
]))


def project_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def test_no_project_file_refers_to_the_shared_folder_beside_the_clone():
    offenders = []
    for path in project_files():
        try:
            text = path.read_text(errors="strict")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "files that reach outside the clone:\n" + "\n".join(offenders)


def test_the_pattern_catches_each_way_of_naming_it():
    folder = "sha" + "red"
    for line in (f'p = ROOT.parent / "{folder}" / "x"', f"cat ../{folder}/x", f"parents[2] / '{folder}'"):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search('{"name": "shared", "mountPath": "/mnt"}')
