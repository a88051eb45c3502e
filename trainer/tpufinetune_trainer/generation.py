"""Each epoch's generation metrics (spec.training.evaluation.generate; --generate-*).

After an epoch's held-out loss, the model answers the first `--generate-examples` held-out
prompts greedily and the answers are scored against the held-out responses:

- exactMatch: the share of answers equal to their response after stripping whitespace;
- rougeL: the mean ROUGE-L F1 (rouge-score's RougeScorer, its default tokenizer);
- bleu: corpus BLEU (sacrebleu's corpus_bleu, one reference per answer).

A prompt is a held-out example's tokens before its first label, its response the labelled
tokens that follow (the first answer); the examples are taken in the held-out blocks' order.
The prompts are shared among the ranks, each generating its own share on its own shard of
the model: FSDP2 gathers one block's parameters at a time
inside every forward, so no rank ever holds the whole model, and every rank must run as
many forwards as the others. Each rank's share is therefore padded to the same count, and
transformers' `generate(synced_gpus=True)` keeps a rank that is done stepping until every
rank is. Rank 0 gathers the answers, scores them (`score`: pure, no model) and writes the
prompts, responses and answers as JSON lines beside the checkpoints:

    <storage>/<run name>/eval-samples/epoch-N.jsonl

A multimodal run's prompt is asked with its example's images (media.with_images): their
pixels made on each rank by the run's image processor (the method's media.Pixels, as the
loss's and the export proof's are), a batch's images in its prompts' order; each sample
names its images (`images`), in the file and in the epoch event's first samples."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

# The API's closed sets (operator/tpufinetune/core/specmodels.py; tests/api/test_trainer_agreement.py).
GENERATION_METRICS = ("exactMatch", "rougeL", "bleu")
KEEP_BEST_BY = ("evalLoss", *GENERATION_METRICS)
DEFAULT_METRICS = ",".join(GENERATION_METRICS)
DEFAULT_MAX_NEW_TOKENS = 64
MAX_NEW_TOKENS = 2048
MAX_EXAMPLES = 4096
# The epoch event carries its first answers (prompt's end, reference, answer, images), the rest in the file.
EVENT_SAMPLES = 8
EVENT_TEXT_CHARS = 160
# Each metric's key in the epoch's metrics (the `epoch` event, the checkpoint's score, eval/* in
# TensorBoard), and the answers scored.
METRIC_KEYS = {"exactMatch": "eval_exact_match", "rougeL": "eval_rouge_l", "bleu": "eval_bleu"}
EXAMPLES_KEY = "eval_generated"
SAMPLES_DIRECTORY = "eval-samples"  # under <storage>/<run name>/


def parse_metrics(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def samples_uri(storage_path: str, run_name: str, epoch: int) -> str:
    return f"{storage_path.rstrip('/')}/{run_name}/{SAMPLES_DIRECTORY}/epoch-{epoch}.jsonl"


@dataclass
class HeldOut:
    """One held-out example as generation sees it: its prompt's token ids and its response's."""

    prompt: list[int]
    response: list[int]
    block: int = -1  # where it is in the held-out blocks (its segment of that block)
    segment: int = -1
    images: list[str] | None = None  # a multimodal run's (media.with_images)


def held_out(packed, count: int, ignore_index: int = -100) -> list[HeldOut]:
    """The first `count` held-out examples that have a prompt and a response, from the held-out
    blocks (data.Packed: each example a segment of a block), in their order."""
    import numpy as np

    found: list[HeldOut] = []
    for block in range(len(packed)):
        real = int(packed.real_tokens[block])
        segments = np.asarray(packed.segment_ids[block][:real])
        for segment in dict.fromkeys(segments.tolist()):
            where = np.flatnonzero(segments == segment)
            ids = [int(t) for t in packed.input_ids[block][where]]
            labels = [int(t) for t in packed.labels[block][where]]
            first = next((k for k, label in enumerate(labels) if label != ignore_index), len(labels))
            end = next((k for k in range(first, len(labels)) if labels[k] == ignore_index), len(labels))
            if 0 < first < end:
                found.append(HeldOut(ids[:first], ids[first:end], block, int(segment)))
            if len(found) == count:
                return found
    return found


def rank_share(total: int, rank: int, world: int) -> tuple[list[int], int]:
    """The indices rank `rank` answers (every world-th from its own) and the count every rank
    pads its share to (the same on all ranks: as many forwards each)."""
    return list(range(rank, total, world)), math.ceil(total / world)


def generate_share(model, prompts: list[list[int]], rank: int, world: int, max_new_tokens: int, pad_id: int,
                   eos_ids: list[int], device, batch_size: int | None = None, images: list[list[str]] | None = None,
                   pixels=None) -> dict[int, list[int]]:
    """Greedy answers (token ids, up to the first end token) to this rank's share of `prompts`,
    by index. Collective: every rank calls it with the same prompts; its share padded with
    copies of a prompt to the common count, answered `batch_size` prompts at a time (the
    training micro-batch: its cache holds far less a token than a training step's saved
    activations), each batch left padded. `images` (a multimodal run): each prompt's images,
    `pixels(locations, device)` their model inputs (media.Pixels), a batch's in its order."""
    indices, per_rank = rank_share(len(prompts), rank, world)
    if per_rank == 0:
        return {}
    filler = indices[0] if indices else 0  # a copy of its own first prompt where it has one
    batch = indices + [filler] * (per_rank - len(indices))
    size = batch_size or per_rank
    answers = {}
    for first in range(0, per_rank, size):  # as many batches on every rank (per_rank is common)
        chunk = batch[first:first + size]
        inputs = pixels([loc for i in chunk for loc in images[i]], device) if images is not None else {}
        for offset, tokens in enumerate(_greedy(model, [prompts[i] for i in chunk], max_new_tokens, pad_id, eos_ids,
                                                device, world, inputs)):
            if first + offset < len(indices):
                answers[indices[first + offset]] = tokens
    return answers


def _greedy(model, batch: list[list[int]], max_new_tokens: int, pad_id: int, eos_ids: list[int], device,
            world: int, inputs: dict | None = None) -> list[list[int]]:
    """One left-padded batch's greedy answers, each up to its first end token; `inputs` its
    images' (pixel_values, image_position_ids), if it has images."""
    import torch

    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 use_cache=True, pad_token_id=pad_id, eos_token_id=eos_ids or None,
                                 synced_gpus=world > 1, **(inputs or {}))
    finally:
        model.train(was_training)
    answers = []
    for row in range(len(batch)):
        tokens = out[row, width:].tolist()
        end = next((k for k, t in enumerate(tokens) if t in eos_ids), len(tokens))
        answers.append(tokens[:end])
    return answers


def score(outputs: list[str], references: list[str], metrics: list[str]) -> dict[str, float]:
    """The named metrics of `outputs` against `references` (one each): exactMatch and rougeL
    as shares in [0, 1], bleu on sacrebleu's 0-100 scale."""
    found: dict[str, float] = {}
    if "exactMatch" in metrics:
        same = sum(o.strip() == r.strip() for o, r in zip(outputs, references))
        found["exactMatch"] = same / len(outputs) if outputs else 0.0
    if "rougeL" in metrics:
        from rouge_score import rouge_scorer

        scorer = rouge_scorer.RougeScorer(["rougeL"])
        values = [scorer.score(r, o)["rougeL"].fmeasure for o, r in zip(outputs, references)]
        found["rougeL"] = sum(values) / len(values) if values else 0.0
    if "bleu" in metrics:
        import sacrebleu

        found["bleu"] = float(sacrebleu.corpus_bleu(outputs, [references]).score) if outputs else 0.0
    return found


def sample_records(prompts: list[str], references: list[str], outputs: list[str],
                   images: list[list[str] | None] | None = None) -> list[dict]:
    """Each answer's record: its prompt, reference and answer, and (a multimodal run) its images."""
    images = images or [None] * len(outputs)
    return [{"prompt": p, "reference": r, "output": o, **({"images": list(i)} if i is not None else {})}
            for p, r, o, i in zip(prompts, references, outputs, images)]


def samples_text(prompts: list[str], references: list[str], outputs: list[str],
                 images: list[list[str] | None] | None = None) -> str:
    """The JSON lines of eval-samples/epoch-N.jsonl."""
    return "".join(json.dumps(record, ensure_ascii=False) + "\n"
                   for record in sample_records(prompts, references, outputs, images))


def event_samples(records: list[dict]) -> list[dict]:
    """The epoch event's: the first EVENT_SAMPLES records, the prompt its end and each text cut."""
    return [{**record, "prompt": record["prompt"][-EVENT_TEXT_CHARS:],
             "reference": record["reference"][:EVENT_TEXT_CHARS], "output": record["output"][:EVENT_TEXT_CHARS]}
            for record in records[:EVENT_SAMPLES]]


def write_samples(uri: str, text: str) -> None:
    from . import storage

    fs, path = storage.filesystem(uri)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as out:
        out.write(text.encode("utf-8"))


def evaluate_generation(trainer) -> tuple[dict, dict]:
    """Collective, after an epoch's held-out loss: every rank answers its share; rank 0 scores
    the answers and writes the samples. Returns (the epoch's metrics, METRIC_KEYS' and
    EXAMPLES_KEY, on every rank; rank 0's record, {} elsewhere: the samples' URI and texts,
    the seconds it all took)."""
    import torch.distributed as dist

    cfg = trainer.cfg
    start = time.perf_counter()
    items = trainer.generation_items
    prompts = [item.prompt for item in items]
    # Rank 0's tokenizer knows which tokens are special: its end tokens go to every rank.
    ends = [end_ids(trainer.model, trainer.tokenizer, items) if trainer.rank == 0 else None]
    dist.broadcast_object_list(ends, src=0, group=trainer.cpu_group)
    eos_ids = ends[0]
    # A multimodal run's prompts are asked with their images, made by the run's image processor.
    images = [item.images or [] for item in items] if cfg.multimodal else None
    mine = generate_share(trainer.model, prompts, trainer.rank, trainer.world, cfg.generate_max_new_tokens,
                          trainer.pad_id, eos_ids, trainer.device, batch_size=cfg.batch_size_per_device,
                          images=images, pixels=trainer.method.pixels if cfg.multimodal else None)
    gathered = [None] * trainer.world if trainer.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=trainer.cpu_group)
    metrics, record = _score_on_rank0(trainer, items, gathered) if trainer.rank == 0 else ({}, {})
    # Every rank's history ranks its checkpoints alike (--keep-best-by): the figures go to all.
    box = [metrics]
    dist.broadcast_object_list(box, src=0, group=trainer.cpu_group)
    if record:
        record["seconds"] = time.perf_counter() - start
    return box[0], record


def _score_on_rank0(trainer, items: list[HeldOut], gathered: list[dict]) -> tuple[dict, dict]:
    cfg = trainer.cfg
    answers = {index: tokens for share in gathered for index, tokens in share.items()}
    decode = trainer.tokenizer.decode
    outputs = [decode(answers[i], skip_special_tokens=True).strip() for i in range(len(items))]
    references = [decode(item.response, skip_special_tokens=True).strip() for item in items]
    # A multimodal prompt's image soft tokens are special: left out, as the export proof leaves them.
    prompt_texts = [decode(item.prompt, skip_special_tokens=cfg.multimodal) for item in items]
    scores = score(outputs, references, parse_metrics(cfg.generate_metrics))
    uri = samples_uri(cfg.storage_path, cfg.run_name, trainer.epoch)
    images = [item.images for item in items]
    records = sample_records(prompt_texts, references, outputs, images)
    text = samples_text(prompt_texts, references, outputs, images)
    try:
        write_samples(uri, text)
    except Exception as exc:  # noqa: BLE001 - storage trouble must never stop training
        print(f"Generation samples not written to {uri}: {type(exc).__name__}: {exc}", flush=True)
        uri = None
    metrics = {METRIC_KEYS[name]: round(value, 4) for name, value in scores.items()}
    metrics[EXAMPLES_KEY] = len(items)
    return metrics, {"uri": uri, "outputs": outputs, "references": references, "prompts": prompt_texts,
                     "samples": event_samples(records)}


def end_ids(model, tokenizer, items: list[HeldOut]) -> list[int]:
    """The tokens that end an answer: the model's generation config's end tokens, and the
    special tokens the held-out responses carry (a chat template's end of turn, which a
    small model's generation config may not name)."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None) if config is not None else None
    if ids is None:
        ids = getattr(getattr(model, "config", None), "eos_token_id", None)
    found = [] if ids is None else [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]
    # Named special tokens, and added ones marked special (decoding skips them; a tokenizer with
    # named media tokens may list its end of turn only there).
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {i for i, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                if getattr(token, "special", False)}
    found += sorted({t for item in items for t in item.response if t in special} - set(found))
    return found


def words(metrics: dict) -> str:
    """The epoch line's part: ' | exact_match=0.5000 rouge_l=0.6000 bleu=12.30 (64 answers)'."""
    if EXAMPLES_KEY not in metrics:
        return ""
    shown = [f"{key.removeprefix('eval_')}={metrics[key]:.4f}" for key in METRIC_KEYS.values() if key in metrics]
    return f" | {' '.join(shown)} ({metrics[EXAMPLES_KEY]} answers)"
