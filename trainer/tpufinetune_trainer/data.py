"""Dolly-format data: load, validate, tokenize, pack into fixed-length blocks.

Static shapes: every example is tokenized as ``<bos> prompt response <eos>`` and packed
(best fit) into blocks of exactly ``max_seq_len`` tokens, the tail padded. Each block
carries position ids that restart at 0 for every example; with no 2-D attention mask,
transformers' mask builder reads those restarts as document boundaries and builds a
block-diagonal causal mask, so an example only attends to itself and sees the same
positions it would see alone. Labels are -100 on the prompt and on padding; since
every example starts with masked prompt tokens, no label ever crosses a boundary.

Runs in the driver (once), not in every worker; workers receive numpy arrays.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError

IGNORE_INDEX = -100
REQUIRED_COLUMNS = ("instruction", "response")  # `context` is optional, as in dolly
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def format_prompt(instruction: str, context: str | None) -> str:
    """The tutorial's prompt (``Instruction: …\\nResponse: …``), plus dolly's context when
    present. The response follows after a space, tokenized with it (byte-level BPE
    attaches the space to the next word)."""
    if context and context.strip():
        return f"Instruction: {instruction}\nContext: {context}\nResponse:"
    return f"Instruction: {instruction}\nResponse:"


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).suffix in _FILE_BUILDERS


def load_rows(dataset: str, split: str):
    """A `datasets.Dataset`: a hub id, a local JSONL/JSON/Parquet/CSV file, or a directory."""
    from datasets import load_dataset

    path = Path(dataset).expanduser()
    if path.is_file() and path.stat().st_size == 0:
        raise DataError(f"--dataset {dataset} is empty: split {split!r} has no rows")
    try:
        if path.is_file():
            builder = _FILE_BUILDERS.get(path.suffix)
            if builder is None:
                raise DataError(f"--dataset {dataset}: unsupported file type {path.suffix!r} "
                                f"(use one of {sorted(_FILE_BUILDERS)})")
            rows = load_dataset(builder, data_files=str(path), split=split)
        elif path.is_dir():
            rows = load_dataset(str(path), split=split)
        elif _looks_like_path(dataset):
            raise DataError(f"--dataset {dataset}: no such file or directory")
        else:
            rows = load_dataset(dataset, split=split)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types; the message is what matters
        if "corresponds to no data" in str(exc):
            raise DataError(f"--dataset {dataset} split {split!r} has no rows") from exc
        raise DataError(f"could not load --dataset {dataset} split {split!r}: {type(exc).__name__}: {exc}") from exc
    if hasattr(rows, "keys") and not hasattr(rows, "column_names"):
        raise DataError(f"--dataset-split {split!r} selects several splits; name one, e.g. 'train[:1024]'")
    return rows


def validate_rows(rows, dataset: str, split: str) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in rows.column_names]
    if missing:
        raise DataError(f"--dataset {dataset} is missing column(s) {missing}; the dolly format needs "
                        f"'instruction' and 'response' (and optionally 'context'); found {rows.column_names}")
    if len(rows) == 0:
        raise DataError(f"--dataset {dataset} split {split!r} has no rows")


@dataclass
class Encoded:
    input_ids: list[list[int]]
    labels: list[list[int]]
    skipped_long_prompts: list[int]  # row indices whose prompt leaves no room for a response
    truncated: int                   # rows whose response was cut at max_seq_len


def encode_rows(rows, tokenizer, max_seq_len: int) -> Encoded:
    """Tokenize every row; prompt tokens get label -100."""
    contexts = rows["context"] if "context" in rows.column_names else [""] * len(rows)
    prompts = [format_prompt(i or "", c) for i, c in zip(rows["instruction"], contexts)]
    responses = [" " + (r or "").strip() for r in rows["response"]]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = Encoded([], [], [], 0)
    for index, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        prompt, response = bos + p, r + eos
        room = max_seq_len - len(prompt)
        if room < 1:
            out.skipped_long_prompts.append(index)
            continue
        if len(response) > room:
            response = response[:room]
            out.truncated += 1
        out.input_ids.append(prompt + response)
        out.labels.append([IGNORE_INDEX] * len(prompt) + response)
    return out


@dataclass
class Packed:
    """Fixed-shape blocks: arrays of [num_blocks, max_seq_len]."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    real_tokens: np.ndarray  # non-padding tokens per block

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def pack(input_ids: list[list[int]], labels: list[list[int]], max_seq_len: int, pad_id: int) -> Packed:
    """Best-fit-decreasing bin packing of examples into blocks of `max_seq_len` tokens."""
    order = sorted(range(len(input_ids)), key=lambda i: (-len(input_ids[i]), i))
    blocks: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, block index), sorted
    for i in order:
        need = len(input_ids[i])
        at = bisect.bisect_left(free, (need, -1))
        if at == len(free):
            blocks.append([i])
            bisect.insort(free, (max_seq_len - need, len(blocks) - 1))
        else:
            room, b = free.pop(at)
            blocks[b].append(i)
            bisect.insort(free, (room - need, b))
    shape = (len(blocks), max_seq_len)
    ids = np.full(shape, pad_id, dtype=np.int64)
    labs = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    pos = np.zeros(shape, dtype=np.int64)
    real = np.zeros(len(blocks), dtype=np.int64)
    for b, members in enumerate(blocks):
        at = 0
        for i in sorted(members):
            n = len(input_ids[i])
            ids[b, at:at + n] = input_ids[i]
            labs[b, at:at + n] = labels[i]
            pos[b, at:at + n] = np.arange(n)
            at += n
        real[b] = at
        pos[b, at:] = np.arange(max_seq_len - at)  # padding is its own "document"
    return Packed(ids, labs, pos, real)


@dataclass
class PreparedData:
    train: Packed
    eval: Packed | None
    examples: int
    eval_examples: int
    skipped_long_prompts: int
    truncated: int


def split_eval(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    if eval_fraction <= 0:
        return list(range(n)), []
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = max(1, int(round(n * eval_fraction)))
    if held >= n:
        raise DataError(f"--eval-fraction {eval_fraction} leaves no training examples out of {n}")
    return sorted(order[held:]), sorted(order[:held])


def prepare(dataset: str, split: str, tokenizer, max_seq_len: int, eval_fraction: float, seed: int,
            long_prompts: str = "skip") -> PreparedData:
    rows = load_rows(dataset, split)
    validate_rows(rows, dataset, split)
    enc = encode_rows(rows, tokenizer, max_seq_len)
    if enc.skipped_long_prompts and (long_prompts == "fail" or not enc.input_ids):
        first = enc.skipped_long_prompts[0]
        raise DataError(f"{len(enc.skipped_long_prompts)} of {len(rows)} examples have a prompt longer than "
                        f"--max-seq-len={max_seq_len} tokens (first: row {first}); raise --max-seq-len"
                        + (" or pass --long-prompts skip" if long_prompts == "fail" else ""))
    train_idx, eval_idx = split_eval(len(enc.input_ids), eval_fraction, seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    def pack_subset(index: list[int]) -> Packed:
        return pack([enc.input_ids[i] for i in index], [enc.labels[i] for i in index], max_seq_len, pad_id)

    return PreparedData(train=pack_subset(train_idx), eval=pack_subset(eval_idx) if eval_idx else None,
                        examples=len(train_idx), eval_examples=len(eval_idx),
                        skipped_long_prompts=len(enc.skipped_long_prompts), truncated=enc.truncated)


def shard_order(num_blocks: int, world_size: int, batch_size: int, epoch: int, seed: int,
                rank: int, shuffle: bool = True) -> np.ndarray:
    """This rank's block indices for one epoch: a seeded permutation shared by all ranks,
    cut to whole global batches (static shapes: no ragged last batch), strided by rank."""
    order = np.arange(num_blocks)
    if shuffle:
        order = np.random.default_rng(seed + epoch).permutation(num_blocks)
    usable = (num_blocks // (world_size * batch_size)) * world_size * batch_size
    return order[:usable][rank::world_size]


def eval_order(num_blocks: int, world_size: int, batch_size: int, rank: int) -> np.ndarray:
    """Every eval block exactly once; -1 marks filler so every rank runs the same number
    of same-shaped batches (filler blocks carry no labels)."""
    per_step = world_size * batch_size
    total = -(-num_blocks // per_step) * per_step
    order = np.full(total, -1, dtype=np.int64)
    order[:num_blocks] = np.arange(num_blocks)
    return order[rank::world_size]
