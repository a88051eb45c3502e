"""The ground's stand-in for the trainer image, built the way Dockerfile.trainer builds it.

Dockerfile.trainer starts FROM the TorchTPU image (Python, torch, torch_tpu, libtpu), installs
the hashed lock for that Python with `--require-hashes --no-deps`, then the project itself
with `pip install --no-deps .`. Here, with no container engine:

- the base image's layer: torch_tpu and libtpu from PyPI (the pinned release below, with
  the dependencies its wheel declares), and torch itself from this checkout's .venv (the
  same torch the dev environment tests; PyPI's linux torch is the CUDA build, several GB,
  which the base image does not carry either). torch and the packages only it needs are
  linked into a directory that a `.pth` file appends to sys.path, the way a base image's
  dist-packages sit under a venv;
- the lock: `pip install --require-hashes --no-deps -r requirements/trainer-py311.lock.txt`;
- the project: `pip install --no-deps .` (a copy, not an editable install), refreshed when
  the sources change (`ensure()`, called by the ground at start), built offline with the
  lock's setuptools (`--no-build-isolation`; the Dockerfile's build downloads its own).

Pods whose image is the trainer's run this environment (tests/harness/nodeagent.py), so the
lock and the TPU import path are what the ground exercises. Building or refreshing it is
this machine's image pull: `ensure()` holds the environment's lock file (`lock_path`) while
it works, so two callers (`make images`, a ground starting beside a running one) take turns,
and the node agent, which asks `state()`, holds a container of that image in
ContainerCreating with a kubelet's `Pulling` event until it is done.

The operator's image (Dockerfile.operator) is built the same way, from its own hashed lock
(`ensure_operator`: no torch, no Ray), and its ENTRYPOINT and CMD are read from the
Dockerfile (`dockerfile_command`), so deploy/'s Deployment, which gives only `args`, runs
as it would from the image.

    python tests/harness/images.py        # build or refresh both (silent when up to date)
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
TORCH_TPU = "torch-tpu==0.2.0"
# Repository names (the last path part of an image reference) that are the trainer's image.
TRAINER_REPOSITORIES = ("trainer", "tpufinetune-trainer")
# What the project copy is built from: a change here reinstalls it.
PACKAGE_SOURCES = ("pyproject.toml", "operator", "trainer")


def python_tag() -> str:
    return f"py{sys.version_info[0]}{sys.version_info[1]}"


def lock_file() -> Path:
    return ROOT / "requirements" / f"trainer-{python_tag()}.lock.txt"


def cache_root() -> Path:
    return Path(os.environ.get("TPUFT_IMAGES_DIR", ROOT / ".cache" / "images"))


def environment_key() -> str:
    digest = hashlib.sha256(lock_file().read_bytes())
    digest.update(TORCH_TPU.encode())
    digest.update(metadata.version("torch").encode())
    return digest.hexdigest()[:12]


def trainer_env() -> Path:
    """The trainer image's environment for this lock (a venv)."""
    return cache_root() / f"trainer-{python_tag()}-{environment_key()}"


def sources_key() -> str:
    digest = hashlib.sha256()
    for name in PACKAGE_SOURCES:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(
            p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts
            and not p.name.endswith(".pyc") and ".egg-info" not in str(p))
        for file in files:
            digest.update(str(file.relative_to(ROOT)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def _pip(env: Path, *args: str) -> None:
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "--disable-pip-version-check",
                    "--quiet", *args], check=True, cwd=ROOT)


def _site_packages(env: Path) -> Path:
    out = subprocess.run([str(env / "bin" / "python"), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _torch_closure(installed: set[str]) -> list[metadata.Distribution]:
    """torch and every distribution it needs that the image does not already have, from
    this interpreter's environment."""
    wanted, seen, found = ["torch"], set(), []
    while wanted:
        name = wanted.pop().lower().replace("_", "-")
        if name in seen or name in installed:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found.append(dist)
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append(requirement.name)
    return found


def _link_base_layer(env: Path) -> None:
    """torch (and what only it needs) linked into base/, appended to the venv's sys.path."""
    site = _site_packages(env)
    installed = {p.name.split("-")[0].lower().replace("_", "-")
                 for p in site.glob("*.dist-info")}
    base = env / "base"
    base.mkdir()
    for dist in _torch_closure(installed):
        top = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for part in top:
            source = Path(dist.locate_file(part))
            if source.exists() and not (base / part).exists():
                (base / part).symlink_to(source)
    (site / "zz_base_image.pth").write_text(str(base) + "\n")


def _venv_with_lock(env: Path, lock: Path) -> Path:
    """A new venv beside `env` (moved there by _move_environment once complete) with the
    hashed lock installed first and alone, as the Dockerfile's first RUN does."""
    partial = env.with_name(env.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(partial)], check=True)
    _pip(partial, "install", "--require-hashes", "--no-deps", "-r", str(lock))
    return partial


def build_environment(env: Path) -> None:
    partial = _venv_with_lock(env, lock_file())
    # The base image's TPU runtime: torch_tpu without torch (linked below), its other needs.
    _pip(partial, "install", "--no-deps", TORCH_TPU)
    _pip(partial, "install", *_torch_tpu_needs(partial))
    _link_base_layer(partial)
    # venv scripts name their interpreter by path: build in place, then move.
    _move_environment(partial, env)
    (_site_packages(env) / "zz_base_image.pth").write_text(str(env / "base") + "\n")


def _torch_tpu_needs(env: Path) -> list[str]:
    """torch_tpu's declared requirements except torch (the base layer's)."""
    out = subprocess.run([str(env / "bin" / "python"), "-c",
                          "import json; from importlib import metadata; "
                          "print(json.dumps(metadata.distribution('torch-tpu').requires or []))"],
                         check=True, capture_output=True, text=True)
    needs = [Requirement(text) for text in json.loads(out.stdout)]
    return [str(r) for r in needs if r.name.lower() != "torch"
            and (r.marker is None or r.marker.evaluate({"extra": ""}))]


def _source_copy(env: Path) -> Path:
    """A clean copy of the sources, as the Dockerfile's COPY lines make (no egg-info, no
    build leftovers of the checkout), in a directory of `env`'s own (another environment
    may build beside it)."""
    build_dir = env.with_name(env.name + ".project-build")
    shutil.rmtree(build_dir, ignore_errors=True)
    build_dir.mkdir(parents=True)
    for name in PACKAGE_SOURCES:
        source = ROOT / name
        if source.is_file():
            shutil.copy2(source, build_dir / name)
        else:
            shutil.copytree(source, build_dir / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    shutil.copy2(ROOT / "README.md", build_dir / "README.md")
    return build_dir


def install_project(env: Path, key: str) -> None:
    build_dir = _source_copy(env)
    # Built with the lock's own setuptools, not an isolated download of the newest: a refresh
    # holds the lock every pod of this image waits on, and needs no network (measured: about
    # 1 s, against 5 s with a download, and minutes of retries behind a proxy that fails).
    _pip(env, "install", "--no-deps", "--no-build-isolation", "--force-reinstall", str(build_dir))
    shutil.rmtree(build_dir, ignore_errors=True)
    (env / ".project").write_text(key)


def lock_path(env: Path) -> Path:
    """The lock `ensure()` holds while it builds or refreshes `env` (beside it, not in it:
    a build replaces the whole directory)."""
    return env.with_name(env.name + ".lock")


@contextlib.contextmanager
def _locked(env: Path, mode: int = fcntl.LOCK_EX):
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(env), "a+") as handle:
        fcntl.flock(handle, mode)
        yield


def _current(env: Path, key: str) -> bool:
    stamp = env / ".project"
    return (env / "bin" / "python").exists() and stamp.exists() and stamp.read_text() == key


# What state() answers: the environment can run a container; another process is building or
# refreshing it (a pull in progress); nobody has built it (`make images`).
READY, PREPARING, MISSING = "ready", "preparing", "missing"


def state(env: Path) -> str:
    """Whether a container of this image can start now (the node agent asks before each
    start). Never waits: a build in progress holds the lock."""
    try:
        with open(lock_path(env), "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return PREPARING
    except OSError:  # no cache directory yet: nothing built
        return MISSING
    return READY if (env / "bin" / "python").exists() and (env / ".project").exists() else MISSING


def preparer(env: Path) -> str:
    """Who holds the environment's lock (`ensure()` building or refreshing it), from the
    kernel's lock table: "pid N (its command line)", or "" when nobody does or it cannot be
    told (another PID namespace)."""
    try:
        inode = os.stat(lock_path(env)).st_ino
        table = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return ""
    for line in table:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:123 0 EOF"; a waiter's line has "->" after the number
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != "WRITE":
            continue
        if fields[5].rsplit(":", 1)[-1] == str(inode) and fields[4].isdigit():
            pid = fields[4]
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                argv = ""
            return f"pid {pid} ({argv[:160]})" if argv else f"pid {pid}"
    return ""


def _ensure(env: Path, build, install) -> Path:
    """`env` built (`build(env)`) if missing, the project in it refreshed (`install(env,
    key)`) if its sources changed. Under its lock (`lock_path`): a second caller waits for
    the first and then finds it current."""
    key = sources_key()
    if _current(env, key):
        return env
    with _locked(env):
        if not (env / "bin" / "python").exists():
            build(env)
        if not _current(env, key):
            install(env, key)
    return env


def ensure() -> Path:
    """The trainer image's environment, built or refreshed; returns its venv."""
    return _ensure(trainer_env(), build_environment, install_project)


# ---- the operator's image (Dockerfile.operator) ---------------------------------------------

# Repository names that are the operator's image (deploy/base/deployment.yaml names
# `.../tpufinetune/operator:TAG`).
OPERATOR_REPOSITORIES = ("operator", "tpufinetune-operator")
OPERATOR_DOCKERFILE = ROOT / "Dockerfile.operator"


def operator_lock() -> Path:
    return ROOT / "requirements" / "operator.lock.txt"


def operator_env() -> Path:
    """The operator image's environment for its lock (a venv)."""
    digest = hashlib.sha256(operator_lock().read_bytes()).hexdigest()[:12]
    return cache_root() / f"operator-{python_tag()}-{digest}"


def _move_environment(partial: Path, env: Path) -> None:
    """A venv built at `partial` moved to `env`: its scripts name their interpreter by path."""
    shutil.rmtree(env, ignore_errors=True)
    partial.rename(env)
    for script in (env / "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            text = script.read_bytes()
            if text.startswith(b"#!") and str(partial).encode() in text:
                script.write_bytes(text.replace(str(partial).encode(), str(env).encode()))
    for cfg in [env / "pyvenv.cfg", *(env / "bin").glob("activate*")]:
        cfg.write_text(cfg.read_text().replace(str(partial), str(env)))


def build_operator_environment(env: Path) -> None:
    """As Dockerfile.operator's first RUN: the hashed lock alone, no dependencies resolved."""
    _move_environment(_venv_with_lock(env, operator_lock()), env)


def install_operator_project(env: Path, key: str) -> None:
    """As the Dockerfile's `pip install --no-deps .`: the project from a clean copy of its
    sources, built into a wheel offline by this interpreter's setuptools (the lock has none;
    the Dockerfile's isolated build downloads it), then installed without dependencies."""
    build_dir = _source_copy(env)
    wheels = build_dir / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet", "wheel", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(build_dir)], check=True, cwd=ROOT)
    _pip(env, "install", "--no-deps", "--force-reinstall", *map(str, wheels.glob("*.whl")))
    shutil.rmtree(build_dir, ignore_errors=True)
    (env / ".project").write_text(key)


def ensure_operator() -> Path:
    """The operator image's environment, built or refreshed; returns its venv."""
    return _ensure(operator_env(), build_operator_environment, install_operator_project)


def dockerfile_command(dockerfile: Path) -> tuple[list[str], list[str]]:
    """The image's ENTRYPOINT and CMD, as its Dockerfile's last ones give them (exec form,
    a JSON list; the shell form runs under /bin/sh -c). A container's `command` replaces
    the first, its `args` the second, as a container runtime does."""
    entrypoint: list[str] = []
    cmd: list[str] = []
    for line in dockerfile.read_text().splitlines():
        word, _, rest = line.strip().partition(" ")
        if word.upper() not in ("ENTRYPOINT", "CMD") or not rest.strip():
            continue
        rest = rest.strip()
        value = json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
        if word.upper() == "ENTRYPOINT":
            entrypoint, cmd = value, []  # a new ENTRYPOINT clears an earlier CMD
        else:
            cmd = value
    return entrypoint, cmd


def main() -> int:
    ensure_operator()
    env = ensure()
    check = subprocess.run([str(env / "bin" / "python"), "-c",
                            "import torch, torch_tpu, ray, tpufinetune_trainer; print(ray.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        print(check.stderr[-2000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
