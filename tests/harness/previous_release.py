"""The previous release, for the upgrade test (tests/operator/test_upgrade_e2e.py): its tag
and the tag's commit, pinned here, and `ensure()`, which makes the commit present in this
clone. A shallow clone (CI's checkout) holds neither the tag nor the commit: `make prepare`
runs this file, which fetches that one commit (depth 1, no history) from the clone's remote,
else the history (`git fetch --unshallow`) and the tag, and stops with a sentence saying
what to run when it cannot. Standard library only: it runs before the venv exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS_RELEASE = "v0.2.0"
# The tag's commit: what the test extracts (`git archive`), tag or no tag.
PREVIOUS_RELEASE_COMMIT = "8eb4e17b080d7f8cb0ad93cc5b04d12ac103e089"


def git(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=check)


def resolved() -> str:
    """The previous release's commit if this clone has it (the tag, else the pinned commit), else ""."""
    for ref in (f"refs/tags/{PREVIOUS_RELEASE}", PREVIOUS_RELEASE_COMMIT):
        found = git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        if found.returncode == 0:
            return found.stdout.strip()
    return ""


def missing_sentence() -> str:
    return (f"the previous release is not in this clone: neither the tag {PREVIOUS_RELEASE} nor its commit "
            f"{PREVIOUS_RELEASE_COMMIT} resolves; fetch it with `git fetch --depth=1 origin "
            f"{PREVIOUS_RELEASE_COMMIT}` (or `git fetch --unshallow origin`)")


def ensure() -> str:
    """The commit, fetched from the clone's remote when missing; SystemExit with what to
    run when it cannot be had."""
    if commit := resolved():
        return commit
    if git("rev-parse", "--git-dir").returncode != 0:
        raise SystemExit(f"{ROOT} is not a git clone: {missing_sentence()}")
    remotes = git("remote").stdout.split()
    if not remotes:
        raise SystemExit(f"this clone has no remote to fetch from: {missing_sentence()}")
    remote = "origin" if "origin" in remotes else remotes[0]
    shallow = git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    tries = [["fetch", "--quiet", *(["--depth=1"] if shallow else []), remote, PREVIOUS_RELEASE_COMMIT],
             ["fetch", "--quiet", "--no-tags", remote, f"refs/tags/{PREVIOUS_RELEASE}:refs/tags/{PREVIOUS_RELEASE}"]]
    if shallow:
        tries.append(["fetch", "--quiet", "--unshallow", remote])
    errors = []
    for args in tries:
        fetched = git(*args)
        if commit := resolved():
            print(f"previous release {PREVIOUS_RELEASE}: fetched {commit[:12]} (git {' '.join(args[:-1])} ...)")
            return commit
        said = next((line for line in fetched.stderr.splitlines() if line.strip()), "it did not bring the commit")
        errors.append(f"`git {' '.join(args)}`: {said}")
    raise SystemExit(f"{missing_sentence()}. Tried: " + "; ".join(errors))


if __name__ == "__main__":
    ensure()
