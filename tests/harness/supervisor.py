"""`make cluster` / `make cluster-down`: the test ground (or, with
TPUFT_CLUSTER_KIND=controlplane, only etcd + kube-apiserver) kept running in the background
by a detached supervisor process, for use by hand.

    python tests/harness/supervisor.py up      # detached; prints `export KUBECONFIG=...`, `export PATH=...`
                                               # and (the ground) `export STORAGE_EMULATOR_HOST=...`
    python tests/harness/supervisor.py status
    python tests/harness/supervisor.py down
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from controlplane import KUBERAY_CRD, KUBERAY_CRD_DISPLAY, ROOT, default_bin_dir, missing_binaries, start_with_crds  # noqa: E402
from processes import alive, command_line, tail  # noqa: E402

# Where `up` keeps its state; TPUFT_CLUSTER_DIR moves it (the harness's own tests do, so
# they never touch a cluster started by hand).
CLUSTER_STATE_DIR = Path(os.environ.get("TPUFT_CLUSTER_DIR") or ROOT / ".cache" / "cluster")
STATE_FILE = CLUSTER_STATE_DIR / "state.json"  # written by the supervisor
PID_FILE = CLUSTER_STATE_DIR / "supervisor.pid"  # written by `up`, before the supervisor is ready


def _read_state() -> dict | None:
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return None


def _export_lines(state: dict) -> str:
    lines = [f"export KUBECONFIG={state['kubeconfig']}", f"export PATH={state['bin_dir']}:$PATH"]
    if state.get("storage_emulator_host"):  # the ground's Cloud Storage, for gs:// by hand
        lines.append(f"export STORAGE_EMULATOR_HOST={state['storage_emulator_host']}")
    return "\n".join(lines)


def _start_stack(workdir: Path):
    """What `up` runs: the whole test ground with the operator (harness/ground.py) and Kueue,
    or, with TPUFT_CLUSTER_KIND=controlplane, only etcd + kube-apiserver with the CRDs."""
    if os.environ.get("TPUFT_CLUSTER_KIND", "ground") == "controlplane":
        cp, _ = start_with_crds(workdir=workdir, out=sys.stdout)
        return cp, cp
    from ground import DEPLOYMENT, Ground

    ground = Ground(workdir=workdir, with_operator=DEPLOYMENT).start()
    try:
        start_queues(ground)
        t = time.monotonic()
        wait_ready_for_samples(ground)
        ground.timings["ready for samples"] = round(time.monotonic() - t, 1)
    except BaseException:
        ground.stop()
        raise
    print(f"ground: up in {sum(ground.timings.values()):.1f}s {ground.timings}", flush=True)
    return ground, ground.cp


def start_queues(ground, namespace: str = "default"):
    """Kueue with the ground's queues (harness/kueue.py), and their LocalQueues in
    `namespace`, so deploy/samples/finetune-v6e-4x4-queued.yaml applies as it is. Stopped
    with the ground."""
    kueue = ground.start_kueue()
    kueue.add_local_queues(namespace)
    return kueue


def sample_readiness(ground, namespace: str = "default") -> dict:
    """What a sample applied the moment `up` returns needs beyond every component answering
    its health check (Ground.start: the node agent sees every pod, the nodes are Ready):
    name -> a check."""
    import images
    from ground import OPERATOR_NAMESPACE, OPERATOR_PODS
    from tpufinetune.settings import Settings

    settings = Settings.from_env(ground.operator.env if ground.operator else {})
    lease, elects = settings.lease_name, settings.leader_election

    def found(path: str) -> dict | None:
        status, body = ground.cp.get_json(path)
        return body if status == 200 else None

    def leading() -> bool:
        body = found(f"/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NAMESPACE}/leases/{lease}") or {}
        return (body.get("spec") or {}).get("holderIdentity") == OPERATOR_PODS[0]

    checks = {
        # The ServiceAccount admission refuses every pod of a namespace until its controller
        # has made the `default` ServiceAccount there.
        f"ServiceAccount {namespace}/default": lambda: found(f"/api/v1/namespaces/{namespace}/serviceaccounts/default") is not None,
        # Built by `make images` and refreshed by Ground.start; another process may be at it.
        "the trainer image's environment": lambda: images.state(images.trainer_env()) == images.READY,
    }
    if ground.operator_objects is not None:  # deploy/'s Deployment: one of its pods leads
        import operator_deployment

        checks[f"an operator pod leading (Lease {OPERATOR_NAMESPACE}/{operator_deployment.LEASE})"] = \
            lambda: bool(operator_deployment.leading_pod(ground.cp))
    elif ground.operator and elects:  # until it leads, the operator's handlers do not run
        checks[f"the operator leading (Lease {OPERATOR_NAMESPACE}/{lease})"] = leading
    return checks


def wait_ready_for_samples(ground, namespace: str = "default", timeout: float = 120.0) -> None:
    from waiting import wait_for

    pending = sample_readiness(ground, namespace)

    def all_ready() -> bool:
        for name, ready in list(pending.items()):
            if ready():
                del pending[name]
        return not pending

    wait_for(all_ready, timeout, "ready for samples", interval=0.3, details=lambda: f"still waiting: {', '.join(pending)}")


def _serve() -> int:
    """The detached supervisor behind `up`: runs the stack until SIGTERM/SIGINT."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    workdir = CLUSTER_STATE_DIR / "run"
    shutil.rmtree(workdir, ignore_errors=True)
    try:
        stack, cp = _start_stack(workdir)
    except Exception as e:  # reported to `up` through the state file
        shutil.rmtree(workdir, ignore_errors=True)
        _write_state({"pid": os.getpid(), "error": str(e)})
        return 1
    try:
        _write_state({
            "pid": os.getpid(),
            "ready": True,
            "server": cp.server,
            "kubeconfig": str(cp.kubeconfig),
            "user_kubeconfig": str(cp.user_kubeconfig),
            "bin_dir": str(cp.bin_dir),
            "version": cp.version,
            "pids": stack.pids,
            "kuberay_crd": str(KUBERAY_CRD) if KUBERAY_CRD.is_file() else None,
            "storage_emulator_host": stack.gcs.endpoint if getattr(stack, "gcs", None) else None,
        })
        while not stop.wait(1.0):
            if not stack.alive():
                print("controlplane: a component exited; stopping", flush=True)
                break
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        try:
            if (_read_state() or {}).get("pid") == os.getpid():
                STATE_FILE.unlink()
        except OSError:
            pass
    return 0


def _write_state(state: dict) -> None:
    tmp = STATE_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(STATE_FILE)  # readers never see half a file


def cmd_up(timeout: float = 240.0) -> int:
    state = _read_state()
    if state and state.get("ready") and _supervisor_pid() == state["pid"]:
        print(_export_lines(state))
        return 0
    if _supervisor_pid() is not None:
        print("controlplane: one is still starting; try again in a moment", file=sys.stderr)
        return 1
    STATE_FILE.unlink(missing_ok=True)
    missing = missing_binaries(default_bin_dir())
    if missing:
        print("controlplane: binaries missing; run `make controlplane` first", file=sys.stderr)
        return 1
    CLUSTER_STATE_DIR.mkdir(parents=True, exist_ok=True)
    log = CLUSTER_STATE_DIR / "supervisor.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "_serve"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=ROOT,
        )
    # Recorded at once, so `down` can stop a supervisor that is still starting.
    PID_FILE.write_text(str(proc.pid))
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = _read_state() or {}
            if state.get("pid") == proc.pid and state.get("ready"):
                if not state.get("kuberay_crd"):
                    print(f"controlplane: KubeRay RayCluster CRD not found at "
                          f"{KUBERAY_CRD_DISPLAY}; not installed", file=sys.stderr)
                print(_export_lines(state))
                return 0
            if state.get("pid") == proc.pid and state.get("error"):
                print(f"controlplane: failed to start: {state['error']}", file=sys.stderr)
                proc.wait(30)
                cmd_down(quiet=True)
                return 1
            if proc.poll() is not None:
                print(f"controlplane: supervisor exited {proc.returncode}:\n{tail(log)}",
                      file=sys.stderr)
                cmd_down(quiet=True)
                return 1
            time.sleep(0.2)
        print(f"controlplane: not ready within {timeout:.0f}s; see {log}", file=sys.stderr)
    except BaseException:  # Ctrl-C while starting: take the supervisor down too
        cmd_down(quiet=True)
        raise
    cmd_down(quiet=True)
    return 1


def _supervisor_pid() -> int | None:
    """The live supervisor's pid, from its state or, while it starts, from `up`'s pid file."""
    candidates = [(_read_state() or {}).get("pid")]
    try:
        candidates.append(int(PID_FILE.read_text()))
    except (OSError, ValueError):
        pass
    for pid in candidates:
        if isinstance(pid, int) and alive(pid) and _is_supervisor(pid):
            return pid
    return None


def _is_supervisor(pid: int) -> bool:
    # Guards against a stale pid file naming a pid that the system has since reused.
    argv = command_line(pid)
    return "_serve" in argv and any(a.endswith("supervisor.py") for a in argv)


def cmd_down(timeout: float = 30.0, quiet: bool = False) -> int:
    say = (lambda *a: None) if quiet else print
    pid = _supervisor_pid()
    if pid is None:
        say("controlplane: not running")
    else:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.1)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)  # its children die with it (PDEATHSIG)
        say("controlplane: stopped")
    STATE_FILE.unlink(missing_ok=True)
    PID_FILE.unlink(missing_ok=True)
    return 0


def cmd_status() -> int:
    state = _read_state()
    if state and state.get("ready") and _supervisor_pid() == state["pid"]:
        pids = " ".join(f"{k}={v}" for k, v in state["pids"].items())
        print(f"controlplane: running {state['version']} at {state['server']} "
              f"(supervisor {state['pid']}, {pids})\n{_export_lines(state)}")
        return 0
    print("controlplane: not running")
    return 1


def main(argv: list[str]) -> int:
    commands = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "_serve": _serve}
    if len(argv) != 1 or argv[0] not in commands:
        print(f"usage: {Path(__file__).name} up|down|status", file=sys.stderr)
        return 2
    try:
        return commands[argv[0]]()
    except KeyboardInterrupt:  # whatever was started is already stopped
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
