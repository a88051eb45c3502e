"""The run's TensorBoard event files, kept in the run's storage beside its checkpoints:

    <storage>/<run name>/tensorboard/attempt-N/events.out.tfevents.*

N is the operator's attempt (TPUFINETUNE_ATTEMPT, as for the logs: logship.ATTEMPT_ENV); a
run by hand without one writes `start-<start id>` instead. Point TensorBoard (or Vertex AI
TensorBoard) at `<storage>/<run name>/tensorboard`: every attempt is one run there, on one
step axis (the optimizer's global step, which a resumed attempt continues from its restored
checkpoint). Steps after that checkpoint which the previous attempt had already written
appear in both folders; the later attempt's are the ones the checkpoint's model went on from.

Rank 0 writes with the `tensorboard` package's writer (torch.utils.tensorboard) into a local
folder and copies its files to storage (the trainer's pyarrow file systems, storage.py: a
`gs://` bucket, fake-gcs-server on the test ground, or a path) at each checkpoint (every
epoch's end among them), on a notice, and at the end, failure included. What was written up
to a checkpoint is in storage before the checkpoint is, so the attempt that resumes from it
finds no gap. An upload that fails is said once and retried at the next flush: storage
trouble never stops training.

Written: per progress event (steps) `train/loss` (the window's mean), `train/learning_rate`,
`train/grad_norm` (clipping on), `train/tokens_per_s`, `train/step_time_s`; per evaluation
`eval/loss` and the method's `eval_*` figures as `eval/*`; per epoch `epoch/loss`,
`epoch/tokens_per_s`, `epoch/padded_tokens_per_s` and the method's other figures as `epoch/*`;
with generation metrics on (generation.py), `eval/exact_match`, `eval/rouge_l`, `eval/bleu`,
`eval/generated` and the epoch's samples as text (`eval/samples`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from . import storage
from .logship import ATTEMPT_ENV

DIRECTORY = "tensorboard"  # under <storage>/<run name>/


def run_uri(storage_path: str, run_name: str) -> str:
    """The folder TensorBoard reads: every attempt of the run is one TensorBoard run in it."""
    return f"{storage_path.rstrip('/')}/{run_name}/{DIRECTORY}"


def attempt_uri(storage_path: str, run_name: str, start_id: str) -> str:
    """This attempt's folder: `attempt-N` from the operator's attempt number, else (a run by
    hand) `start-<start id>`, so two starts never write into one folder."""
    attempt = os.environ.get(ATTEMPT_ENV, "").strip()
    name = f"attempt-{int(attempt)}" if attempt.isdigit() and int(attempt) >= 1 else f"start-{start_id}"
    return f"{run_uri(storage_path, run_name)}/{name}"


class Board:
    """Rank 0's event writer; on every other rank (`enabled` False) each call does nothing."""

    def __init__(self, uri: str, enabled: bool = True):
        self.uri, self.enabled = uri, enabled
        self.writer = None
        self.local: str | None = None
        self.uploaded: dict[str, int] = {}  # file name -> size in storage
        self.errors = 0
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.local = tempfile.mkdtemp(prefix="tpuft-tensorboard-")
            # No timed flush of its own: flush() writes the file before each upload.
            self.writer = SummaryWriter(log_dir=self.local, max_queue=1000, flush_secs=3600)

    def scalars(self, step: int, values: dict) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, float(value), global_step=step)

    def progress(self, fields: dict) -> None:
        """A `progress` event's figures at its step."""
        self.scalars(fields["step"], {"train/loss": fields.get("loss"), "train/learning_rate": fields.get("lr"),
                                      "train/grad_norm": fields.get("grad_norm"),
                                      "train/tokens_per_s": fields.get("tokens_per_s"),
                                      "train/step_time_s": fields.get("step_time_s")})

    def evaluation(self, metrics: dict, epoch_end: bool) -> None:
        """A report's figures at its step: the evaluation's (eval_loss, the method's eval_*)
        always, the epoch's own at an epoch's end."""
        values = {}
        for key, value in metrics.items():
            if key.startswith("eval_"):
                values[f"eval/{key.removeprefix('eval_')}"] = value
            elif epoch_end and key not in ("epoch", "step", "epoch_time_s"):
                values[f"epoch/{key}"] = value
        self.scalars(metrics["step"], values)

    def samples(self, step: int, samples: dict, shown: int = 16) -> None:
        """An epoch's generation samples (generation.py) as text, `eval/samples`: the first
        `shown` prompts, references and answers, one markdown table."""
        if self.writer is None or not samples:
            return

        def cell(text: str) -> str:
            return text.replace("|", "\\|").replace("\n", "<br>")

        rows = ["| prompt | reference | answer |", "| --- | --- | --- |"]
        rows += [f"| {cell(p)} | {cell(r)} | {cell(o)} |" for p, r, o in
                 list(zip(samples["prompts"], samples["references"], samples["outputs"]))[:shown]]
        self.writer.add_text("eval/samples", "\n".join(rows), global_step=step)

    def flush(self) -> None:
        """Write what is queued and copy every file that changed to storage. The writer
        appends to one file; a changed file is copied whole (objects are immutable)."""
        if self.writer is None:
            return
        try:
            self.writer.flush()
            fs, root = storage.filesystem(self.uri)
            fs.create_dir(root, recursive=True)
            for name in sorted(os.listdir(self.local)):
                path = os.path.join(self.local, name)
                if not os.path.isfile(path) or self.uploaded.get(name) == os.path.getsize(path):
                    continue
                size = os.path.getsize(path)
                with open(path, "rb") as source, fs.open_output_stream(f"{root}/{name}") as out:
                    shutil.copyfileobj(source, out)
                self.uploaded[name] = size
        except Exception as exc:  # noqa: BLE001 - storage trouble must never stop training
            self.errors += 1
            if self.errors == 1:
                print(f"TensorBoard events not copied to {self.uri} (retried at the next flush): "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """The last flush; the local folder goes."""
        if self.writer is None:
            return
        self.flush()
        self.writer.close()
        self.writer = None
        shutil.rmtree(self.local, ignore_errors=True)
