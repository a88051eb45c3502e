"""`tpufinetune-train finetune|collectives`: the Ray job entrypoint.

Whatever goes wrong (a bad flag, bad input, a worker crash) ends with one `failure`
event naming the problem and a non-zero exit status, so the Ray job is FAILED and the
operator can say why.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from .config import DEFAULT_DATASET, DEFAULT_MODEL, SCORE_ATTRIBUTES, CollectivesConfig, FinetuneConfig
from .errors import TrainerError, UsageError
from .events import emit

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
    ft.add_argument("--model-id", default=DEFAULT_MODEL, help="hub id or local model directory")
    ft.add_argument("--dataset", default=DEFAULT_DATASET, help="hub id, or a local JSONL/Parquet file or directory")
    ft.add_argument("--dataset-split", default="train[:1024]")
    _slice_flags(ft)
    ft.add_argument("--num-epochs", type=int, default=3)
    ft.add_argument("--batch-size-per-device", type=int, default=4)
    ft.add_argument("--storage-path", default=os.environ.get("STORAGE_PATH", ""),
                    help="checkpoint storage (gs://… or a shared path); default $STORAGE_PATH")
    ft.add_argument("--max-seq-len", type=int, default=512, help="tokens per packed block")
    ft.add_argument("--learning-rate", type=float, default=2e-5)
    ft.add_argument("--weight-decay", type=float, default=0.01)
    ft.add_argument("--seed", type=int, default=42)
    ft.add_argument("--eval-fraction", type=float, default=0.05, help="share of examples held out for eval loss")
    ft.add_argument("--keep-checkpoints", type=int, default=1, help="checkpoints Ray Train keeps (best first)")
    ft.add_argument("--checkpoint-score-attribute", default="loss", choices=list(SCORE_ATTRIBUTES))
    ft.add_argument("--checkpoint-score-order", default="min", choices=["min", "max"])
    ft.add_argument("--resume-from", default=None, help="checkpoint directory or URI to continue from")
    ft.add_argument("--run-name", default="", help="Ray Train run name (default: from the model id + time)")
    ft.add_argument("--long-prompts", default="skip", choices=["skip", "fail"],
                    help="examples whose prompt alone exceeds --max-seq-len: skip them (counted) or fail")

    co = sub.add_parser("collectives", help="interconnect check: DTensor TP parity + all_reduce")
    _slice_flags(co)
    co.add_argument("--hidden-dim", type=int, default=128)
    co.add_argument("--batch-size", type=int, default=64)
    co.add_argument("--placement-timeout", type=float, default=600.0, help="seconds to wait for the devices")
    co.add_argument("--corrupt-rank", type=int, default=None,
                    help="fault injection for tests: perturb this rank's weight shard (the check must fail)")
    return parser


def _config(args: argparse.Namespace):
    if args.command == "finetune":
        return FinetuneConfig(
            topology=args.topology, accelerator_type=args.accelerator_type, num_workers=args.num_workers,
            device=args.device, model_id=args.model_id, dataset=args.dataset, dataset_split=args.dataset_split,
            num_epochs=args.num_epochs, batch_size_per_device=args.batch_size_per_device,
            storage_path=args.storage_path, max_seq_len=args.max_seq_len, learning_rate=args.learning_rate,
            weight_decay=args.weight_decay, seed=args.seed, eval_fraction=args.eval_fraction,
            keep_checkpoints=args.keep_checkpoints, checkpoint_score_attribute=args.checkpoint_score_attribute,
            checkpoint_score_order=args.checkpoint_score_order, resume_from=args.resume_from,
            run_name=args.run_name, long_prompts=args.long_prompts)
    return CollectivesConfig(topology=args.topology, accelerator_type=args.accelerator_type,
                             num_workers=args.num_workers, device=args.device, hidden_dim=args.hidden_dim,
                             batch_size=args.batch_size, placement_timeout_s=args.placement_timeout,
                             corrupt_rank=args.corrupt_rank)


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
    try:
        args = build_parser().parse_args(argv)
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
