"""`tpufinetune-train lmeval`: lm-evaluation-harness on a fine-tune's export.

The operator submits it on the run's own RayCluster once the fine-tune's export is written
and proven, before the slice is released. The driver (on the Ray head, which holds no
accelerator) checks its input cheapest first, before anything is loaded: the flags, the
run's storage writable, the export there (its config.json), the include folder readable and
every task known to lm-eval (an unknown one is named with the close names it has). Then it
says `lmeval_start` and runs the evaluation as one Ray task with one worker's resources (a
TPU worker's `TPU` chip; the cpu stand-in's worker CPU), so it lands on a worker host. There
the export and the include folder are copied to local disk with the trainer's storage code,
the export is loaded with the trainer's loader (text-only for Gemma 4, as the export proof
loads it) onto the device backends.py brings up (torch_tpu imported only on a TPU host), and
`lm_eval.simple_evaluate` runs lm-eval's HF model on it with the tasks of a
`TaskManager(include_path=...)`. Back in the driver, lm-eval's results dict is written to
`<storage>/<run>/evaluation/results.json` and each task's figures become one `lmeval_task`
event, then `lmeval_result` (docs/protocol.md). Whatever fails ends in one `failure`
(`EvaluationFailed`, naming the task, the include folder or the export, and the fix).

`evaluate` is the whole flow, its host part in this process (InProcess: what the tests run) or
as one Ray task (RayTask: the job's, `run`).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import storage
from .backends import BACKENDS, COMPUTE_DTYPES, Backend, resolve
from .errors import EvaluationFailed, UsageError

# Where the results go under the run's storage (the `lmeval_result` event's results_uri).
RESULTS_PATH = "evaluation/results.json"
# What lm-eval writes where a figure has no standard error (or a group no version).
NO_STDERR = "N/A"
CLOSE_NAMES = 5  # close task names offered for an unknown one


@dataclass(frozen=True)
class LmevalConfig:
    run_name: str
    storage_path: str
    model_uri: str
    tasks: tuple[str, ...]
    num_fewshot: int | None = None
    limit: int | float | None = None  # a whole number of documents per task, or a fraction below 1
    include_path: str | None = None
    batch_size: int = 1
    dtype: str = "auto"  # backends.COMPUTE_DTYPES: auto is the device's compute dtype
    max_length: int | None = None
    device: str = "auto"

    def validate(self) -> None:
        """UsageError naming the flag, for values lm-eval would take wrongly or late."""
        if not self.run_name:
            raise UsageError("--run-name is required: the run whose storage gets evaluation/results.json")
        if not self.storage_path:
            raise UsageError("--storage-path is required (or $STORAGE_PATH): the run's storage, gs://... or a path")
        if not self.model_uri:
            raise UsageError("--model-uri is required: the export to evaluate (<storage>/<run>/export)")
        if not self.tasks:
            raise UsageError("--task is required: an lm-eval task or group to run, once per task")
        twice = sorted({task for task in self.tasks if self.tasks.count(task) > 1})
        if twice:
            raise UsageError(f"--task {', '.join(twice)} is given twice: name each task once")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise UsageError(f"--num-fewshot must be 0 or more, got {self.num_fewshot}")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.max_length is not None and self.max_length < 1:
            raise UsageError(f"--max-length must be at least 1 token, got {self.max_length}")
        if self.dtype not in COMPUTE_DTYPES:
            raise UsageError(f"unknown --dtype {self.dtype!r}; choose one of {', '.join(COMPUTE_DTYPES)}")

    def results_uri(self) -> str:
        return results_uri(self.storage_path, self.run_name)


# --------------------------------------------------------------------------- pure


def parse_limit(text: str) -> int | float:
    """--limit as lm-eval reads it: a fraction of each task's documents below 1 (0.1), else a
    whole number of documents (5, or 5.0). Anything else is a UsageError naming the flag."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0 or (value >= 1 and value != int(value)):
        raise UsageError(f"--limit {text!r}: give a fraction of each task's documents below 1 (e.g. 0.1) or a "
                         "whole number of documents (1 or more)")
    return int(value) if value >= 1 else value


def results_uri(storage_path: str, run_name: str) -> str:
    return f"{storage_path.rstrip('/')}/{run_name}/{RESULTS_PATH}"


def unknown_tasks_message(unknown: list[str], known: list[str], include_path: str | None) -> str:
    """The failure's words for tasks lm-eval does not know: each with its close names."""
    parts = []
    for task in unknown:
        close = difflib.get_close_matches(task, known, n=CLOSE_NAMES, cutoff=0.6)
        parts.append(f"{task} (close names: {', '.join(close)})" if close else f"{task} (no close name)")
    where = (f"lm-eval {_lm_eval_version()}'s tasks nor the task YAML under --include-path {include_path}"
             if include_path else f"lm-eval {_lm_eval_version()}'s tasks (no --include-path given)")
    return (f"--task: no such task in {where}: {'; '.join(parts)}. Use a task or group name lm-eval lists "
            "(lm-eval ls tasks), or define it in a YAML file under --include-path")


def _lm_eval_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("lm-eval")
    except metadata.PackageNotFoundError:
        return "?"


def json_safe(value: Any) -> Any:
    """lm-eval's results as strict JSON: dict keys as strings, tuples and sets as lists, numpy
    and torch scalars as numbers, a figure that is not finite as null, anything else (a torch
    dtype, a path, a function) as its string."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):  # numpy's float64 among them
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(item) for item in value]
    item = getattr(value, "item", None)  # numpy and torch scalars
    if callable(item) and getattr(value, "shape", None) == ():
        return json_safe(item())
    return str(value)


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def task_metrics(figures: dict) -> list[dict]:
    """One task's figures from lm-eval's `results[task]` ({"acc,none": 0.41, "acc_stderr,none":
    0.01, ...}): each metric and filter with its value and standard error (None where lm-eval
    has "N/A" or no figure)."""
    metrics = []
    for key, value in figures.items():
        name, comma, filter_name = key.partition(",")
        if not comma or name.endswith("_stderr"):
            continue  # name, alias, sample_len; the standard errors go with their metric
        stderr = figures.get(f"{name}_stderr,{filter_name}")
        metrics.append({"metric": name, "filter": filter_name, "value": _number(value),
                        "stderr": None if stderr == NO_STDERR else _number(stderr)})
    return metrics


def task_reports(results: dict, requested: tuple[str, ...] | list[str]) -> list[dict]:
    """The `lmeval_task` events' fields from lm-eval's (JSON-safe) results dict: the tasks and
    groups asked for first, in their order, then every other row lm-eval reports (a group's
    subtasks), in its order."""
    rows = results.get("results") or {}
    order = [name for name in requested if name in rows] + [name for name in rows if name not in requested]
    reports = []
    for name in order:
        figures = rows[name]
        counted = (results.get("n-samples") or {}).get(name) or {}
        samples = counted.get("effective", figures.get("sample_len"))
        version = (results.get("versions") or {}).get(name)
        reports.append({"task": name, "metrics": task_metrics(figures), "samples": samples,
                        "num_fewshot": (results.get("n-shot") or {}).get(name),
                        "version": None if version == NO_STDERR else version})
    return reports


def host_resources(backend: Backend) -> dict:
    """The Ray task options that place the evaluation as one of the fine-tune's workers is
    placed: a TPU worker's chip (no CPU, as the collectives' actors), a GPU, or the cpu
    stand-in's worker CPU (the head advertises none)."""
    if backend.name == "tpu":
        return {"num_cpus": 0, "resources": {backend.ray_resource: 1}}
    return {"num_cpus": 1, "num_gpus": 1 if backend.name == "cuda" else 0}


# --------------------------------------------------------------------------- adapters


def check_storage(cfg: LmevalConfig) -> None:
    from .finetune import check_storage as probe

    probe(cfg.storage_path, cfg.run_name)


def check_export(model_uri: str) -> None:
    """The export is a model directory (its config.json), read without downloading it."""
    try:
        found = storage.exists(f"{model_uri.rstrip('/')}/config.json", "file")
    except Exception as exc:  # noqa: BLE001 - whatever stops the read is the reason
        raise EvaluationFailed(f"--model-uri {model_uri}: cannot read it: {type(exc).__name__}: {exc}. Give the "
                               "fine-tune's export (<storage>/<run>/export) where this cluster can read it") from exc
    if not found:
        raise EvaluationFailed(f"--model-uri {model_uri}: no model there (no config.json). Give the fine-tune's "
                               "export, a from_pretrained directory (<storage>/<run>/export)")


def local_include(include_path: str) -> Path:
    """The include folder on this host's disk (a URI downloaded once per host); EvaluationFailed
    when it cannot be read or holds no task YAML."""
    try:
        local = storage.local_copy(include_path) if storage.is_uri(include_path) else Path(include_path)
        yamls = sorted(local.rglob("*.yaml")) if local.is_dir() else []  # what lm-eval indexes
    except Exception as exc:  # noqa: BLE001
        raise EvaluationFailed(f"--include-path {include_path}: cannot read it: {type(exc).__name__}: {exc}. Give a "
                               "folder of lm-eval task YAML files (and their data) this cluster can read: "
                               "gs://bucket/prefix, or a path mounted in the Ray pods") from exc
    if not local.is_dir():
        raise EvaluationFailed(f"--include-path {include_path}: no such folder. Give a folder of lm-eval task YAML "
                               "files (and their data): gs://bucket/prefix, or a path mounted in the Ray pods")
    if not yamls:
        raise EvaluationFailed(f"--include-path {include_path}: the folder holds no task YAML (*.yaml). Put each "
                               "task's YAML file (lm-eval's task format) and its data there")
    return local


@dataclass
class _TaskIndex:
    """lm-eval's TaskManager, kept per include folder as it is now: indexing lm-eval's own
    task YAML takes seconds, and the checks and the evaluation of one process share it."""

    managers: dict = field(default_factory=dict)

    def get(self, include_dir: Path | None, defaults: bool = True):
        """The TaskManager of `include_dir` (and of lm-eval's own tasks, with `defaults`)."""
        from lm_eval.tasks import TaskManager

        files = (tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(include_dir.rglob("*"))
                       if p.is_file()) if include_dir is not None else ())
        key = (str(include_dir), files, defaults)
        if key not in self.managers:
            self.managers = {k: v for k, v in self.managers.items() if k[:2] == key[:2]}  # this folder's only
            self.managers[key] = TaskManager(include_path=str(include_dir) if include_dir is not None else None,
                                             include_defaults=defaults)
        return self.managers[key]


TASK_INDEX = _TaskIndex()


def check_tasks(tasks: tuple[str, ...], include_path: str | None) -> None:
    """Every task is one lm-eval knows, under the include folder or its own (indexed only
    for a name the folder does not define: lm-eval's own index takes seconds to build)."""
    include_dir = local_include(include_path) if include_path else None
    defined = set(TASK_INDEX.get(include_dir, defaults=False).all_tasks) if include_dir is not None else set()
    if all(task in defined for task in tasks):
        return
    known = TASK_INDEX.get(include_dir).all_tasks
    unknown = [task for task in tasks if task not in set(known)]
    if unknown:
        raise EvaluationFailed(unknown_tasks_message(unknown, known, include_path))


def check(cfg: LmevalConfig) -> None:
    """The driver's input checks, cheapest first, before any host is asked for."""
    cfg.validate()
    check_storage(cfg)
    check_export(cfg.model_uri)
    check_tasks(cfg.tasks, cfg.include_path)


@contextlib.contextmanager
def _inside(directory: Path | None):
    """Run in the include folder, so a task YAML's relative data_files name its own data."""
    if directory is None:
        yield
        return
    with contextlib.chdir(directory):
        yield


def _load_export(cfg: LmevalConfig, backend: Backend):
    """(model on its device, tokenizer) of the export, loaded as the export proof loads it."""
    from .backends import compute_dtype, setup_device
    from .model import load_causal_lm, load_tokenizer, model_source

    device = setup_device(backend, 0)  # Ray gives the task its own chip or GPU: index 0
    try:
        source = model_source(cfg.model_uri)
        model = load_causal_lm(source, compute_dtype(backend, cfg.dtype), backend.attn_implementation)
        return model.to(device).eval(), load_tokenizer(source)
    except Exception as exc:  # noqa: BLE001
        raise EvaluationFailed(f"the export at --model-uri {cfg.model_uri} does not load: {type(exc).__name__}: "
                               f"{_first_line(exc)}. Give the fine-tune's export (<storage>/<run>/export), written "
                               "and proven by its export_proof") from exc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [repr(exc)])[0][:2000]


def evaluate_on_host(cfg: LmevalConfig, backend_name: str) -> dict:
    """The host's part: the export and the include folder copied here, the export loaded on
    this host's device, lm-eval run. Returns {"results": lm-eval's dict, JSON-safe,
    "evaluate_s": seconds of simple_evaluate, "device": where it ran}."""
    backend = BACKENDS[backend_name]
    if backend.name == "tpu":
        from .tpu_guard import require_tpu_device

        require_tpu_device(worker_rank=0, world_size=1)
    include_dir = local_include(cfg.include_path) if cfg.include_path else None
    manager = TASK_INDEX.get(include_dir)
    model, tokenizer = _load_export(cfg, backend)
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    # The model loaded above (its device is the trainer's choice: HFLM's own device list has no TPU).
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size, max_length=cfg.max_length)
    start = time.perf_counter()
    try:
        with _inside(include_dir):
            results = simple_evaluate(model=lm, tasks=list(cfg.tasks), num_fewshot=cfg.num_fewshot, limit=cfg.limit,
                                      task_manager=manager, log_samples=False)
    except Exception as exc:  # noqa: BLE001
        where = f" (task YAML under --include-path {cfg.include_path})" if cfg.include_path else ""
        raise EvaluationFailed(f"lm-eval could not evaluate --task {', '.join(cfg.tasks)}{where} on the export at "
                               f"{cfg.model_uri}: {type(exc).__name__}: {_first_line(exc)}. Check each task's YAML "
                               "and its data (a relative data_files path is read from the include folder); "
                               "lm-eval's traceback is in the job log") from exc
    seconds = time.perf_counter() - start
    if not results:
        raise EvaluationFailed(f"lm-eval returned no results for --task {', '.join(cfg.tasks)}")
    return {"results": json_safe(results), "evaluate_s": round(seconds, 3), "device": str(model.device)}


def write_results(uri: str, results: dict) -> None:
    fs, path = storage.filesystem(uri)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as out:
        out.write((json.dumps(results, indent=2, sort_keys=False) + "\n").encode())


class InProcess:
    """The host's part in this process: the tests', or a run by hand on one machine (the
    device: --device, auto from this host's devices, never by initialising a TPU)."""

    def __init__(self, device: str = "auto"):
        self.device = device

    def backend(self) -> Backend:
        return resolve(self.device)

    def evaluate(self, cfg: LmevalConfig, backend: Backend) -> dict:
        return evaluate_on_host(cfg, backend.name)


class RayTask:
    """The host's part as one Ray task with one worker's resources (host_resources), so it
    runs on a worker host of the job's cluster, never on the head."""

    def __init__(self, device: str = "auto"):
        self.device = device

    def backend(self) -> Backend:
        import ray

        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
        backend = resolve(self.device, ray.cluster_resources())
        options = host_resources(backend)
        need = {**options.get("resources", {}), "CPU": options["num_cpus"], "GPU": options.get("num_gpus", 0)}
        have = ray.cluster_resources()
        short = {name: amount for name, amount in need.items() if amount and have.get(name, 0) < amount}
        if short:
            raise EvaluationFailed(f"the Ray cluster has no worker with {short} to evaluate on (it advertises "
                                   f"{have}): the run's workers must still be up")
        return backend

    def evaluate(self, cfg: LmevalConfig, backend: Backend) -> dict:
        import ray

        task = ray.remote(evaluate_on_host).options(**host_resources(backend), max_retries=0, name="lmeval")
        return ray.get(task.remote(cfg, backend.name))


def evaluate(cfg: LmevalConfig, host: InProcess | RayTask | None = None,
             emit: Callable[..., Any] | None = None) -> dict:
    """The whole evaluation: the checks (before any cluster or device is touched),
    `lmeval_start`, the host's part (in this process by default), results.json, one
    `lmeval_task` per task and `lmeval_result`. Returns the results as written."""
    from .events import emit as emit_event

    say = emit or emit_event
    check(cfg)
    host = host or InProcess(cfg.device)
    backend = host.backend()
    say("lmeval_start", tasks=list(cfg.tasks), num_fewshot=cfg.num_fewshot, limit=cfg.limit,
        model_uri=cfg.model_uri, include_path=cfg.include_path, device=backend.name)
    outcome = host.evaluate(cfg, backend)
    results = outcome["results"]
    results["tpufinetune"] = {"run_name": cfg.run_name, "model_uri": cfg.model_uri, "include_path": cfg.include_path,
                              "device": outcome["device"], "evaluate_s": outcome["evaluate_s"]}
    uri = cfg.results_uri()
    try:
        write_results(uri, results)
    except Exception as exc:  # noqa: BLE001
        raise EvaluationFailed(f"lm-eval's results could not be written to {uri}: {type(exc).__name__}: {exc} "
                               "(--storage-path)") from exc
    reports = task_reports(results, cfg.tasks)
    for report in reports:
        say("lmeval_task", **report)
    say("lmeval_result", results_uri=uri, tasks=[r["task"] for r in reports], evaluate_s=outcome["evaluate_s"])
    for report in reports:
        figures = ", ".join(f"{m['metric']}[{m['filter']}]={m['value']}" for m in report["metrics"])
        print(f"lm-eval {report['task']}: {figures} ({report['samples']} documents)", flush=True)
    return results


def run(cfg: LmevalConfig) -> int:
    """The Ray job's entry (cli.py): the host's part as one Ray task."""
    evaluate(cfg, RayTask(cfg.device))
    return 0
