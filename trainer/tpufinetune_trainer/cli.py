"""`tpufinetune-train finetune|collectives|lmeval|checkpoint-now`: the Ray job entrypoint.

Whatever goes wrong (a bad flag, bad input, a worker crash) ends with one `failure`
event naming the problem and a non-zero exit status, so the Ray job is FAILED and the
operator can say why.
"""

from __future__ import annotations

# First: its import is the driver's start mark (the attempt's start-up stages count from it).
from . import startup  # noqa: F401  isort: skip

import argparse
import contextlib
import io
import os
import sys
import traceback

from .backends import COMPILE_CACHE_ENV, COMPILE_MODES, COMPUTE_DTYPES
from .config import (ACTIVATION_CHECKPOINTING, ATTENTION, DEFAULT_BATCH_SIZE_PER_DEVICE, DEFAULT_DATASET,
                     DEFAULT_DECAY_RATIO, DEFAULT_MODEL, LOSS_HEADS, MODEL_LOADS,
                     SCORE_ATTRIBUTES, CollectivesConfig, FinetuneConfig, normalise_storage)
from .data import DATASET_FORMATS, LOSS_ON, PROMPT_FORMATS
from . import generation
from .lora import DEFAULT_TARGET_MODULES, METHODS
from .schedule import SCHEDULES
from .errors import Preempted, TrainerError, UsageError
from .events import emit
from .logship import DRIVER, attempt_logs_uri, shipping

EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit(2) without an event
        raise UsageError(f"{self.prog}: {message}")


def _slice_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", default="4x4", help="TPU slice topology, e.g. 4x4 (v6e) or 2x2x2 (v7x)")
    p.add_argument("--accelerator-type", default="TPU-V6E", help="Ray TPU accelerator type (TPU-V6E, TPU-V7X, …)")
    p.add_argument("--num-workers", type=int, default=16, help="worker processes, one per device")
    p.add_argument("--device", default="auto", choices=["auto", "tpu", "cuda", "cpu"],
                   help="auto picks what the Ray cluster advertises (TPU, then GPU, else CPU)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tpufinetune-train", description="TPUFineTune trainer (runs as a Ray job).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    ft = sub.add_parser("finetune", help="supervised fine-tuning with Ray Train + FSDP2")
    ft.add_argument("--model-id", default=DEFAULT_MODEL, help="hub id, local model directory, or one in a bucket (gs://...)")
    ft.add_argument("--dataset", default=DEFAULT_DATASET, help="hub id, or a JSONL/Parquet file or directory, local or in a bucket (gs://...)")
    ft.add_argument("--dataset-split", default="train[:1024]")
    _slice_flags(ft)
    ft.add_argument("--num-slices", type=int, default=1,
                    help="TPU slices the workers span: HSDP, the model sharded within a slice and replicated across")
    ft.add_argument("--shard-group", type=int, default=0,
                    help="devices one copy of the model state is sharded over, within a slice, replicated "
                         "across the groups (1: every device holds it all); 0: the whole slice")
    ft.add_argument("--num-epochs", type=int, default=3)
    ft.add_argument("--batch-size-per-device", type=int, default=DEFAULT_BATCH_SIZE_PER_DEVICE,
                    help="examples per device per optimizer step (the tutorial's batch size), packed into "
                         "blocks of --max-seq-len tokens")
    # --global-batch-blocks: the name the operator passes (its field globalBatchBlocks).
    ft.add_argument("--global-batch-examples", "--global-batch-blocks", dest="global_batch_examples", type=int,
                    default=0,
                    help="examples per optimizer step over all devices; a multiple of devices x batch size, the "
                         "factor being gradient accumulation (default 0: devices x batch size, no accumulation)")
    ft.add_argument("--tokens-per-step", type=int, default=0,
                    help="MaxText's way: token positions per optimizer step over all devices, full packed "
                         "blocks whatever examples they hold; a multiple of devices x --batch-size-per-device "
                         "(then blocks per device per micro-batch) x --max-seq-len, the factor being gradient "
                         "accumulation (default 0: a step is --global-batch-examples examples)")
    ft.add_argument("--storage-path", default=os.environ.get("STORAGE_PATH", ""),
                    help="checkpoint storage (gs://… or a shared path); default $STORAGE_PATH")
    ft.add_argument("--max-seq-len", type=int, default=512, help="tokens per packed block")
    ft.add_argument("--learning-rate", type=float, default=2e-5, help="peak AdamW learning rate")
    ft.add_argument("--lr-schedule", default="cosine", choices=list(SCHEDULES),
                    help="after linear warmup and the peak held: cosine or linear decay over the last "
                         "--decay-ratio of steps to --min-lr-ratio x peak, or constant")
    ft.add_argument("--warmup-ratio", type=float, default=0.05, help="share of all optimizer steps spent warming up")
    ft.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak")
    ft.add_argument("--decay-ratio", type=float, default=DEFAULT_DECAY_RATIO,
                    help="share of all optimizer steps, at the end, over which the rate decays; the peak is "
                         "held until then (1: decay over every step after the warmup)")
    ft.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    ft.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: epochs decide)")
    ft.add_argument("--weight-decay", type=float, default=0.01)
    ft.add_argument("--seed", type=int, default=42)
    ft.add_argument("--eval-fraction", type=float, default=0.05, help="share of examples held out for eval loss")
    ft.add_argument("--keep-checkpoints", type=int, default=1,
                    help="checkpoints Ray Train keeps (best first; the latest is always kept for recovery)")
    ft.add_argument("--checkpoint-every-steps", type=int, default=0,
                    help="also checkpoint every N optimizer steps (0: at the end of every epoch only)")
    ft.add_argument("--checkpoint-score-attribute", default="auto", choices=list(SCORE_ATTRIBUTES),
                    help="auto: eval_loss when there is an eval split, else loss")
    ft.add_argument("--checkpoint-score-order", default="min", choices=["min", "max"])
    ft.add_argument("--resume-from", default=None, help="checkpoint directory or URI to continue from")
    ft.add_argument("--init-checkpoint", default=None,
                    help="a new run from the weights of a checkpoint (directory or URI) of this trainer, on the "
                         "base of --model-id (that run's): a full fine-tune's weights, or LoRA's adapters merged in; "
                         "no optimizer state, step or data position")
    ft.add_argument("--run-name", default="", help="Ray Train run name (default: from the model id + time)")
    ft.add_argument("--long-prompts", default="skip", choices=["skip", "fail"],
                    help="examples whose prompt alone exceeds --max-seq-len: skip them (counted) or fail")
    ft.add_argument("--prompt-format", default="auto", choices=list(PROMPT_FORMATS),
                    help="chat: the tokenizer's chat template (labels on assistant turns, see --loss-on); tutorial: "
                         "'Instruction: ...\\nResponse: ...'; auto: chat when the tokenizer has a template")
    ft.add_argument("--loss-on", default="responses", choices=list(LOSS_ON),
                    help="responses: the loss on assistant turns (the response) only; all: on every token, prompt "
                         "included, as the tutorial's loop")
    ft.add_argument("--dataset-format", default="auto", choices=list(DATASET_FORMATS),
                    help="dolly (instruction/context/response), messages (role/content turns) or "
                         "prompt-completion; auto: from the columns")
    ft.add_argument("--loss-head", default="labels", choices=list(LOSS_HEADS),
                    help="labels: the LM head and loss at label positions only, in chunks; full: transformers' "
                         "logits at every position")
    ft.add_argument("--model-load", default=MODEL_LOADS[0], choices=list(MODEL_LOADS),
                    help="sharded: build the model on the meta device, shard it, each worker reads only its own "
                         "slices of the safetensors, and a checkpoint it cannot read by name and shape is an "
                         "error naming the mismatch; full: every worker loads the whole model, then shards it; "
                         "sharded-or-full: sharded, else full (only where a full fp32 copy per worker fits the host)")
    ft.add_argument("--compile", default="auto", choices=list(COMPILE_MODES),
                    help="torch.compile each decoder block (auto: on for CUDA, off for TPU until measured "
                         "on a slice, off for CPU)")
    ft.add_argument("--compile-cache-dir", default=os.environ.get(COMPILE_CACHE_ENV, ""),
                    help="keep compiled programs (inductor's caches; TorchTPU's persistent cache on TPU) in this "
                         f"directory, a volume that outlives the pod (default ${COMPILE_CACHE_ENV}; empty: each "
                         "process's own, lost with the pod)")
    ft.add_argument("--compute-dtype", default="auto", choices=list(COMPUTE_DTYPES),
                    help="forward/backward dtype (auto: bfloat16 on TPU and CUDA, float32 on CPU); "
                         "trained weights and their optimizer state are always float32 (--method lora: the frozen base "
                         "is bfloat16)")
    ft.add_argument("--progress-interval", type=float, default=30.0,
                    help="seconds between progress events within an epoch")
    ft.add_argument("--max-failures", type=int, default=0,
                    help="worker failures Ray Train recovers from inside this job, each resuming from the "
                         "latest checkpoint")
    ft.add_argument("--target-eval-loss", type=float, default=0.0,
                    help="stop after the evaluation whose eval loss is at or below this, and export the "
                         "checkpoint it reached (0: off; needs --eval-fraction > 0)")
    ft.add_argument("--early-stopping-patience", type=int, default=0,
                    help="stop after this many evaluations in a row without a lower eval loss "
                         "(0: off; needs --eval-fraction > 0)")
    ft.add_argument("--method", default=METHODS[0], choices=list(METHODS),
                    help="full: train every weight (fp32 masters, AdamW state for all); lora: freeze the base "
                         "in bfloat16 and train low-rank adapters only (peft), fp32 masters for them; dpo: "
                         "preference tuning on chosen/rejected pairs (--dpo-*)")
    ft.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r (--method lora)")
    ft.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha: the update is alpha / r x B A")
    ft.add_argument("--lora-dropout", type=float, default=0.05, help="dropout on the adapters' input")
    ft.add_argument("--lora-target-modules", default=",".join(DEFAULT_TARGET_MODULES),
                    help="comma-separated module names of the language model to adapt (default: the attention "
                         "and MLP projections)")
    ft.add_argument("--lora-export-merged", default="true", choices=["true", "false"],
                    help="also export the base with the adapter merged in (the adapter alone is always exported)")
    ft.add_argument("--lora-train-embeddings", default="false", choices=["true", "false"],
                    help="also train the input embedding in full (and a head tied to it) beside the adapters: "
                         "fp32 master, gradient and AdamW state for it; the adapter export carries it "
                         "(peft's modules_to_save)")
    ft.add_argument("--dpo-beta", type=float, default=0.1,
                    help="--method dpo: how far the policy may move from the reference (DPO's beta; IPO's tau)")
    ft.add_argument("--dpo-loss", default="sigmoid", choices=["sigmoid", "ipo"],
                    help="--method dpo: sigmoid (DPO) or ipo (IPO, each log-ratio per response token)")
    ft.add_argument("--dpo-label-smoothing", type=float, default=0.0,
                    help="--method dpo, sigmoid only: the probability a pair's preference is flipped "
                         "(conservative DPO), in [0, 0.5)")
    ft.add_argument("--dpo-reference-free", default="false", choices=["true", "false"],
                    help="--method dpo: no reference model (its log-probabilities taken as 0)")
    ft.add_argument("--dpo-lora", default="false", choices=["true", "false"],
                    help="--method dpo: train LoRA adapters (the --lora-* settings) on the frozen base, the "
                         "reference being the base with them switched off; false trains every weight, the "
                         "reference's log-probabilities computed once before the first step")
    ft.add_argument("--activation-checkpointing", default=ACTIVATION_CHECKPOINTING[0],
                    choices=list(ACTIVATION_CHECKPOINTING),
                    help="recompute activations in the backward instead of keeping them: block, every decoder "
                         "block (keeps only each block's input); selective, each block's self-attention only "
                         "(its scores, queries, keys and values); none keeps everything")
    ft.add_argument("--attention", default=ATTENTION[0], choices=list(ATTENTION),
                    help="transformers' attention kernel: eager (the tutorial's, scores of every head in memory) "
                         "or sdpa (torch's scaled_dot_product_attention); auto: eager on TPU, sdpa on GPU and CPU")
    ft.add_argument("--freeze-embeddings", default="false", choices=["true", "false"],
                    help="do not train the input embedding (nor a head tied to it): no gradient, no AdamW state")
    ft.add_argument("--reshard-after-forward", default="true", choices=["true", "false"],
                    help="free each block's gathered parameters after its forward and gather them again for its "
                         "backward (true, memory-safe); false keeps them, one all-gather a block fewer per "
                         "micro-batch for the whole model's copy in the compute dtype on every device")
    ft.add_argument("--vision-tower", default="", choices=["frozen", "trained"],
                    help="a multimodal run: the whole model is loaded with its towers and the data rendered with "
                         "its processor (image parts); frozen: the vision tower takes no gradient (its projector "
                         "trains); trained: the tower trains too (with --method lora, adapters on its attention and "
                         "MLP projections named in --lora-target-modules); absent: a text run on the language model "
                         "only")
    ft.add_argument("--audio-tower", default="", choices=["frozen", "trained"],
                    help="audio fine-tuning is not built yet: refused")
    ft.add_argument("--max-images-per-example", type=int, default=1,
                    help="images a row may hold at most (a row with more is refused, naming it)")
    ft.add_argument("--generate-examples", type=int, default=0,
                    help="after each epoch's held-out loss, answer this many held-out prompts greedily (shared "
                         "among the devices) and score the answers against the responses (0: off)")
    ft.add_argument("--generate-max-new-tokens", type=int, default=generation.DEFAULT_MAX_NEW_TOKENS,
                    help="tokens generated at most per answer")
    ft.add_argument("--generate-metrics", default=generation.DEFAULT_METRICS,
                    help=f"comma-separated scores of the answers: some of {', '.join(generation.GENERATION_METRICS)}")
    ft.add_argument("--keep-best-by", default=generation.KEEP_BEST_BY[0], choices=list(generation.KEEP_BEST_BY),
                    help="what makes a checkpoint the best: evalLoss (--checkpoint-score-attribute decides) or a "
                         "generated metric, the highest winning")
    ft.add_argument("--fail-at-step", type=int, default=0,
                    help="fault injection for tests: fail once after this optimizer step (not after a restore)")

    now = sub.add_parser("checkpoint-now", help="ask the running finetune of --run-name for a step checkpoint "
                                                "now (run as a Ray job on the same cluster)")
    now.add_argument("--run-name", required=True, help="the finetune's --run-name")
    now.add_argument("--reason", default="Requested", help="why, shown in the trainer's notice event")
    now.add_argument("--detail", default="", help="e.g. the node and its maintenance time")

    co = sub.add_parser("collectives", help="interconnect check: DTensor TP parity + all_reduce")
    _slice_flags(co)
    co.add_argument("--num-slices", type=int, default=1,
                    help="TPU slices the workers span: also measured within each slice (ICI) and across (DCN)")
    co.add_argument("--hidden-dim", type=int, default=128)
    co.add_argument("--batch-size", type=int, default=64)
    co.add_argument("--placement-timeout", type=float, default=600.0, help="seconds to wait for the devices")
    co.add_argument("--bandwidth-mib", type=float, default=64.0,
                    help="MiB of fp32 all_reduced to measure the bus bandwidth (0: not measured)")
    co.add_argument("--min-bus-bandwidth-gbps", type=float, default=0.0,
                    help="fail when the measured all_reduce bus bandwidth is under this many GB/s (0: no floor)")
    co.add_argument("--corrupt-rank", type=int, default=None,
                    help="fault injection for tests: perturb this rank's weight shard (the check must fail)")
    _lmeval_parser(sub)
    return parser


def _lmeval_parser(sub) -> None:
    from .backends import COMPUTE_DTYPES as DTYPES
    from .lmeval import parse_limit

    ev = sub.add_parser("lmeval", help="lm-evaluation-harness on a fine-tune's export, on one worker host")
    ev.add_argument("--run-name", required=True, help="the fine-tune's run: results go to <storage>/<run>/evaluation/")
    ev.add_argument("--storage-path", default=os.environ.get("STORAGE_PATH", ""),
                    help="the run's storage (gs://... or a shared path); default $STORAGE_PATH")
    ev.add_argument("--model-uri", required=True, help="the export to evaluate: a from_pretrained directory, path or "
                                                       "gs:// URI (<storage>/<run>/export)")
    ev.add_argument("--task", dest="tasks", action="append", default=[], required=True,
                    help="an lm-eval task or group (hellaswag, arc_easy, mmlu, a task of --include-path); repeat "
                         "for more")
    ev.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt (default: each "
                                                                  "task's own)")
    ev.add_argument("--limit", type=parse_limit, default=None,
                    help="documents per task: a fraction below 1 (0.1) or a whole number (default: every document)")
    ev.add_argument("--include-path", default=None,
                    help="a folder of task YAML files and their data, path or gs:// URI (lm-eval's --include_path)")
    ev.add_argument("--batch-size", type=int, default=1, help="requests per forward (lm-eval's default 1)")
    ev.add_argument("--dtype", default="auto", choices=list(DTYPES),
                    help="dtype the export is loaded in (auto: bfloat16 on TPU and GPU, float32 on CPU)")
    ev.add_argument("--max-length", type=int, default=None,
                    help="tokens of context at most (default: the model config's)")
    ev.add_argument("--device", default="auto", choices=["auto", "tpu", "cuda", "cpu"],
                    help="auto picks what the Ray cluster advertises (TPU, then GPU, else CPU)")


def request_checkpoint(args: argparse.Namespace) -> int:
    import ray

    from .notice import put_request

    ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    request = put_request(args.run_name, args.reason, args.detail)
    print(f"asked run {args.run_name} for a checkpoint now ({request['reason']}"
          f"{': ' + request['detail'] if request['detail'] else ''})", flush=True)
    return 0


def _config(args: argparse.Namespace):
    if args.command == "finetune":
        return FinetuneConfig(
            topology=args.topology, accelerator_type=args.accelerator_type, num_workers=args.num_workers,
            device=args.device, num_slices=args.num_slices, shard_group=args.shard_group,
            model_id=args.model_id, dataset=args.dataset, dataset_split=args.dataset_split,
            num_epochs=args.num_epochs, batch_size_per_device=args.batch_size_per_device,
            global_batch_examples=args.global_batch_examples, tokens_per_step=args.tokens_per_step,
            storage_path=args.storage_path,
            max_seq_len=args.max_seq_len, learning_rate=args.learning_rate, lr_schedule=args.lr_schedule,
            warmup_ratio=args.warmup_ratio, min_lr_ratio=args.min_lr_ratio, decay_ratio=args.decay_ratio,
            max_grad_norm=args.max_grad_norm,
            max_steps=args.max_steps, weight_decay=args.weight_decay, seed=args.seed,
            eval_fraction=args.eval_fraction, keep_checkpoints=args.keep_checkpoints,
            checkpoint_every_steps=args.checkpoint_every_steps,
            checkpoint_score_attribute=args.checkpoint_score_attribute,
            checkpoint_score_order=args.checkpoint_score_order, resume_from=args.resume_from,
            init_checkpoint=args.init_checkpoint,
            run_name=args.run_name, long_prompts=args.long_prompts, prompt_format=args.prompt_format,
            loss_on=args.loss_on,
            dataset_format=args.dataset_format, compile=args.compile, compile_cache_dir=args.compile_cache_dir,
            compute_dtype=args.compute_dtype,
            loss_head=args.loss_head, model_load=args.model_load,
            progress_interval_s=args.progress_interval, max_failures=args.max_failures,
            target_eval_loss=args.target_eval_loss, early_stopping_patience=args.early_stopping_patience,
            fail_at_step=args.fail_at_step, method=args.method, lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
            lora_target_modules=args.lora_target_modules, lora_export_merged=args.lora_export_merged == "true",
            lora_train_embeddings=args.lora_train_embeddings == "true",
            dpo_beta=args.dpo_beta, dpo_loss=args.dpo_loss, dpo_label_smoothing=args.dpo_label_smoothing,
            dpo_reference_free=args.dpo_reference_free == "true", dpo_lora=args.dpo_lora == "true",
            activation_checkpointing=args.activation_checkpointing, attention=args.attention,
            freeze_embeddings=args.freeze_embeddings == "true",
            reshard_after_forward=args.reshard_after_forward == "true",
            generate_examples=args.generate_examples, generate_max_new_tokens=args.generate_max_new_tokens,
            generate_metrics=args.generate_metrics, keep_best_by=args.keep_best_by,
            vision_tower=args.vision_tower, audio_tower=args.audio_tower,
            max_images_per_example=args.max_images_per_example)
    return CollectivesConfig(topology=args.topology, accelerator_type=args.accelerator_type,
                             num_workers=args.num_workers, device=args.device, hidden_dim=args.hidden_dim,
                             batch_size=args.batch_size, placement_timeout_s=args.placement_timeout,
                             corrupt_rank=args.corrupt_rank, bandwidth_mib=args.bandwidth_mib,
                             min_bus_bandwidth_gbps=args.min_bus_bandwidth_gbps, num_slices=args.num_slices)


def _lmeval_config(args: argparse.Namespace):
    from .lmeval import LmevalConfig

    return LmevalConfig(run_name=args.run_name, storage_path=normalise_storage(args.storage_path) if args.storage_path
                        else "", model_uri=args.model_uri, tasks=tuple(args.tasks), num_fewshot=args.num_fewshot,
                        limit=args.limit, include_path=args.include_path, batch_size=args.batch_size,
                        dtype=args.dtype, max_length=args.max_length, device=args.device)


def root_cause(exc: BaseException) -> BaseException:
    """The worker's own exception inside Ray's wrappers (TrainingFailedError, RayTaskError)."""
    for _ in range(10):
        failures = getattr(exc, "worker_failures", None)
        if failures:
            exc = failures[min(failures)]
            continue
        inner = getattr(exc, "controller_failure", None) or getattr(exc, "cause", None)
        if isinstance(inner, BaseException) and inner is not exc:
            exc = inner
            continue
        break
    return exc


def _message(exc: BaseException) -> str:
    text = str(exc).strip() or repr(exc)
    return text if len(text) <= 4000 else text[:4000] + " …"


def main(argv: list[str] | None = None) -> int:
    # A finetune driver's output, its failure event included, kept with the attempt's logs.
    with shipping(DRIVER, _logs_uri(argv), on_sigterm=True):
        return _command(argv)


def _logs_uri(argv: list[str] | None) -> str:
    """Where a finetune driver's logs go (logship; '' for anything else, or a bad command
    line, which `_command` reports)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # --help once
            args = build_parser().parse_args(argv)
    except (UsageError, SystemExit):
        return ""
    if args.command not in ("finetune", "lmeval"):  # lmeval's driver: after the fine-tune's, in the same stream
        return ""
    return attempt_logs_uri(normalise_storage(args.storage_path) if args.storage_path else "", args.run_name)


def _command(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "checkpoint-now":
            return request_checkpoint(args)
        if args.command == "lmeval":
            from . import lmeval

            return lmeval.run(_lmeval_config(args))
        cfg = _config(args)
        if args.command == "finetune":
            from .finetune import run
        else:
            from .collectives import run
        return run(cfg)
    except KeyboardInterrupt:
        emit("failure", type="Interrupted", message="interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every failure must become an event
        cause = root_cause(exc)
        if not isinstance(cause, TrainerError):
            traceback.print_exc(file=sys.stderr)
        if isinstance(cause, Preempted) and cause.notice:
            emit("notice", **cause.notice)  # again, from the driver: rank 0's line may have gone with its pod
        emit("failure", type=type(cause).__name__, message=_message(cause))
        print(f"ERROR: {type(cause).__name__}: {_message(cause)}", file=sys.stderr, flush=True)
        return EXIT_USAGE if isinstance(cause, UsageError) else EXIT_FAILURE
    finally:
        _shutdown_ray()


def _shutdown_ray() -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
