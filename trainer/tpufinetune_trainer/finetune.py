"""`finetune` driver: check everything cheap first, prepare the data once, run Ray Train.

Every input problem is found here, before a slice is reserved, and ends the run with a
`failure` event and a non-zero exit (see cli.py): a missing model or dataset, missing
columns, an empty split, over-long prompts, unwritable storage, a worker count the slice
or the cluster cannot hold.
"""

from __future__ import annotations

import os
import uuid

from . import backends, compile_cache, startup, storage
from .config import FinetuneConfig
from .data import Examples, PreparedData, epoch_step_count, pad_id_of, prepare
from .errors import ConfigError, StorageError
from .events import emit
from .model import check_model, config_report, load_config, load_tokenizer


def check_storage(storage_path: str, run_name: str) -> None:
    """Write and delete a probe file where checkpoints will go."""
    try:
        fs, root = storage.filesystem(storage_path)
        run_dir = f"{root.rstrip('/')}/{run_name}"
        fs.create_dir(run_dir, recursive=True)
        probe = f"{run_dir}/.tpuft-write-probe-{uuid.uuid4().hex}"
        with fs.open_output_stream(probe) as f:
            f.write(b"ok")
        fs.delete_file(probe)
    except Exception as exc:
        raise StorageError(f"--storage-path {storage_path} is not writable: {type(exc).__name__}: {exc}") from exc


def check_resume_from(uri: str) -> None:
    try:
        found = storage.exists(f"{uri.rstrip('/')}/.metadata", "file")
    except Exception as exc:
        raise ConfigError(f"--resume-from {uri}: cannot read it: {exc}") from exc
    if not found:
        raise ConfigError(f"--resume-from {uri} is not a checkpoint of this trainer (no DCP .metadata)")


def run_checkpoint(cfg: FinetuneConfig) -> str | None:
    """The newest complete checkpoint in the run's directory (what a resume takes first)."""
    from . import checkpoint as ckpt

    return ckpt.latest_complete(ckpt.join_uri(cfg.storage_path, cfg.run_name))


def check_resume(cfg: FinetuneConfig, data: PreparedData) -> None:
    """Before any worker starts: the checkpoint the workers would continue from (the run
    directory's newest complete one, else --resume-from) must be this run's and complete.
    The workers check again what they are handed (train.Trainer.restore); this one fails in
    seconds, before Ray Train reserves the slice or retries under --max-failures."""
    from . import checkpoint as ckpt
    from . import resume

    location = run_checkpoint(cfg) or cfg.resume_from
    if not location:
        return
    if not ckpt.is_complete(location):
        raise ConfigError(f"--resume-from {location} is not a complete checkpoint (its trainer state, DCP metadata "
                          "or a shard the metadata names is missing or short): resume from a complete one")
    state = ckpt.read_trainer_state(location)
    current = resume.fingerprint(cfg, cfg.num_workers, data.train)
    resume.check(state, current, location)
    resume.position(state, current["steps_per_epoch"], location)


def check_cluster_fits(backend: backends.Backend, num_workers: int, resources: dict) -> None:
    """Fail now rather than wait forever for workers the cluster can never place."""
    need = {"CPU": float(num_workers)}
    if backend.ray_resource:
        need[backend.ray_resource] = float(num_workers)
    if backend.name == "tpu":
        need.pop("CPU")
    short = {k: (v, resources.get(k, 0.0)) for k, v in need.items() if resources.get(k, 0.0) < v}
    if short:
        detail = ", ".join(f"{k}: need {v:g}, cluster has {have:g}" for k, (v, have) in short.items())
        raise ConfigError(f"the Ray cluster cannot hold --num-workers {num_workers} ({detail})")


def check(cfg: FinetuneConfig) -> None:
    """Input checks, cheapest first (the training stack takes a while to import)."""
    cfg.validate()
    check_storage(cfg.storage_path, cfg.run_name)
    if cfg.resume_from and not run_checkpoint(cfg):
        # Only when it is the one resumed from: the run's own newest complete checkpoint
        # wins over it (an attempt may be handed the URI of a checkpoint that a later
        # attempt's retention deleted since, once that attempt had written newer ones).
        check_resume_from(cfg.resume_from)
    check_model(cfg.model_id)


def prepare_data(cfg: FinetuneConfig) -> tuple[PreparedData, int]:
    """Tokenize the dataset once, on the driver (training examples are packed per step in
    the workers, from each epoch's order; the evaluation's here). Returns the data and the
    tokenizer's pad id."""
    from .sharded_load import check_dense

    config = load_config(cfg.model_id)
    check_dense(config, cfg.model_id)  # before the slice is reserved
    # Its widths, for the operator's memory plan (status.plan), before any weight is loaded.
    if cfg.multimodal:  # rendered with the model's processor, images as references (media.py)
        from .media import load_media_processor, prepare_media
        from .model import model_source

        processor = load_media_processor(model_source(cfg.model_id))
        # With the vision tower's widths and the processor's tokens per image, so the plan
        # counts the model's own tower.
        emit("model", config=config_report(config, processor.image_processor))
        data = prepare_media(cfg.dataset, cfg.dataset_split, processor, cfg.max_seq_len, cfg.eval_fraction, cfg.seed,
                             cfg.long_prompts, cfg.max_images_per_example)
        return data, pad_id_of(processor.tokenizer)
    emit("model", config=config_report(config))
    tokenizer = load_tokenizer(cfg.model_id)
    if cfg.method == "dpo":  # preference pairs (preference.py), held in memory
        from .preference import prepare_pairs

        data = prepare_pairs(cfg.dataset, cfg.dataset_split, tokenizer, cfg.max_seq_len, cfg.eval_fraction,
                             cfg.seed, cfg.long_prompts, cfg.prompt_format, cfg.dataset_format)
        return data, pad_id_of(tokenizer)
    from .data_stream import run_data_uri

    # An earlier attempt's published entry is taken before anything is tokenized (a retry
    # on a new head host, whose disk has no entry).
    data = prepare(cfg.dataset, cfg.dataset_split, tokenizer, cfg.max_seq_len, cfg.eval_fraction, cfg.seed,
                   cfg.long_prompts, cfg.prompt_format, cfg.dataset_format, cfg.loss_on,
                   published=run_data_uri(cfg.storage_path, cfg.run_name))
    return data, pad_id_of(tokenizer)


def shipped_examples(train: Examples, cfg: FinetuneConfig, alive_nodes: int) -> Examples:
    """The training examples as the workers receive them. Prepared files are published to
    the run's storage once (data_stream.publish; uploads nothing when a complete copy is
    there): a later attempt's driver takes them instead of tokenizing, and workers on
    other hosts than this driver (GKE: the driver in the head pod, the workers on TPU
    hosts), which cannot map the driver's files, fetch and map one copy per host (the
    examples pickle as a description). Examples held in memory ship as they are (Ray's
    object store, shared by a host's workers)."""
    from . import data_stream

    try:
        shipped = data_stream.publish(train, cfg.storage_path, cfg.run_name)
    except OSError as e:
        raise StorageError(f"could not publish the prepared dataset to the run's storage {cfg.storage_path} "
                           f"(--storage-path), kept there for later attempts and the workers on other hosts: {e}") from e
    if shipped is not train:
        print(f"Data: published to {shipped.input_ids.part.mirror} for later attempts"
              + (" and the workers' hosts (each fetches one copy and maps it)" if alive_nodes > 1 else ""),
              flush=True)
    return shipped


def build_trainer(cfg: FinetuneConfig, data: PreparedData, pad_id: int):
    """The Ray Train TorchTrainer for this cluster: backend and scaling from what the
    cluster offers (refused when it cannot hold the workers), data shipped once by ref."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    from .train import train_func

    backend = backends.resolve(cfg.device, ray.cluster_resources())
    scaling = backends.scaling_config(backend, cfg.num_workers, cfg.topology, cfg.accelerator_type,
                                      cfg.num_slices)
    check_cluster_fits(backend, cfg.num_workers, ray.cluster_resources())
    print(f"Starting Ray Train FSDP2 SFT job: model={cfg.model_id}, topology={cfg.topology}, "
          f"accelerator_type={cfg.accelerator_type}, num_workers={cfg.num_workers}, backend={backend.name}", flush=True)
    print(f"Data: {data.examples} train examples (packed per optimizer step) / {data.eval_examples} eval examples "
          f"packed into {len(data.eval) if data.eval else 0} blocks of {cfg.max_seq_len} tokens "
          f"({data.skipped_long_prompts} skipped for long prompts, {data.truncated} responses truncated); "
          f"dataset format {data.dataset_format}, prompt format {data.prompt_format}, loss on {cfg.loss_on}", flush=True)
    train = shipped_examples(data.train, cfg, alive_nodes=sum(1 for n in ray.nodes() if n.get("Alive")))
    data_ref = ray.put({"train": train, "eval": data.eval, "pad_id": pad_id})
    return TorchTrainer(
        train_loop_per_worker=train_func,
        train_loop_config={"cfg": cfg.to_dict(), "backend": backend.name, "data": data_ref,
                           "prompt_format": data.prompt_format, "dataset_format": data.dataset_format,
                           "startup": startup.DRIVER.handover()},
        torch_config=backends.torch_config(backend, cfg.compile_cache_dir, cfg.num_slices,
                                           compile_cache.run_cache_uri(cfg, backend)),
        scaling_config=scaling,
        run_config=RunConfig(
            name=cfg.run_name,
            **storage.ray_storage(cfg.storage_path),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints,
                                               checkpoint_score_attribute=cfg.checkpoint_score_attribute,
                                               checkpoint_score_order=cfg.checkpoint_score_order),
            # A worker that dies restarts the worker group, which resumes from the
            # latest (step-level) checkpoint inside this same job.
            failure_config=FailureConfig(max_failures=cfg.max_failures),
        ),
    )


def run(cfg: FinetuneConfig) -> int:
    check(cfg)
    import ray

    from .train import quiet_progress_bars

    quiet_progress_bars()
    data, pad_id = prepare_data(cfg)
    startup.DRIVER.note(data_source=getattr(data, "source", "tokenized"),
                        tokenized_examples=getattr(data, "tokenized_examples", data.examples))
    epoch_step_count(data.train.lengths, cfg.batch_plan())  # refuses data too small for one step, before Ray
    check_resume(cfg, data)
    startup.DRIVER.mark("data_ready")
    ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    result = build_trainer(cfg, data, pad_id).fit()
    print(f"Training completed! Final metrics: {result.metrics}", flush=True)
    print(f"Saved checkpoint: {result.checkpoint}", flush=True)
    return 0
