"""Training data: load, recognise the format, render prompts, tokenize, pack into blocks.

Formats (`--dataset-format`): dolly (`instruction`, optional `context`, `response`),
`messages` (a list of `{role, content}` turns) and `prompt`/`completion`. Prompt formats
(`--prompt-format`): `chat` renders every example with the tokenizer's own chat template
(what an instruct model such as gemma-4-E2B-it was trained on), `tutorial` is the
tutorial's ``Instruction: …\\nResponse: …``. Labels are the assistant turns only
(-100 everywhere else), so the loss measures answers, never prompts or padding.

Static shapes: examples are packed (best fit) into blocks of exactly ``max_seq_len``
tokens. Each block carries segment ids (one per example, padding is its own segment)
and position ids that restart at 0 for every example; the trainer turns the segment ids
into block-diagonal attention masks, so an example only attends to itself and sees the
positions it would see alone. Every example starts with prompt tokens (label -100), so
no label ever crosses a boundary.

Runs in the driver (once), not in every worker; workers receive numpy arrays.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import storage
from .errors import DataError

IGNORE_INDEX = -100
DATASET_FORMATS = ("auto", "dolly", "messages", "prompt-completion")
PROMPT_FORMATS = ("auto", "chat", "tutorial")
COLUMNS = {"dolly": ("instruction", "response"), "messages": ("messages",),
           "prompt-completion": ("prompt", "completion")}
REQUIRED_COLUMNS = COLUMNS["dolly"]  # `context` is optional, as in dolly
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


def local_dataset(dataset: str) -> Path:
    """The local path to read: a file or directory in storage (gs://…) is downloaded
    first, once per host; anything else is taken as it is."""
    if not storage.is_uri(dataset):
        return Path(dataset).expanduser()
    try:
        return storage.local_copy(dataset)
    except FileNotFoundError as exc:
        raise DataError(f"--dataset {dataset}: no such object or directory") from exc
    except Exception as exc:
        raise DataError(f"--dataset {dataset}: cannot download it: {type(exc).__name__}: {exc}") from exc


def load_rows(dataset: str, split: str):
    """A `datasets.Dataset`: a hub id, a JSONL/JSON/Parquet/CSV file, or a directory, local
    or in storage (gs://bucket/train.jsonl)."""
    from datasets import load_dataset

    path = local_dataset(dataset)
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


def detect_format(columns: list[str], dataset: str, requested: str = "auto") -> str:
    """The dataset format: the requested one (its columns must be there) or, for `auto`,
    the first whose columns are all present."""
    if requested not in DATASET_FORMATS:
        raise DataError(f"--dataset-format {requested!r}: choose one of {', '.join(DATASET_FORMATS)}")
    if requested != "auto":
        missing = [c for c in COLUMNS[requested] if c not in columns]
        if missing:
            raise DataError(f"--dataset {dataset} is missing column(s) {missing} for --dataset-format "
                            f"{requested}; found {columns}")
        return requested
    for name in ("messages", "prompt-completion", "dolly"):
        if all(c in columns for c in COLUMNS[name]):
            return name
    raise DataError(f"--dataset {dataset} is missing column(s) {list(REQUIRED_COLUMNS)}: no known format fits "
                    f"its columns {columns}. Use dolly ('instruction', 'response', optional 'context'), "
                    f"'messages' (a list of role/content turns) or 'prompt' + 'completion', "
                    f"and name it with --dataset-format")


def validate_rows(rows, dataset: str, split: str, dataset_format: str = "auto") -> str:
    found = detect_format(list(rows.column_names), dataset, dataset_format)
    if len(rows) == 0:
        raise DataError(f"--dataset {dataset} split {split!r} has no rows")
    return found


def resolve_prompt_format(requested: str, tokenizer) -> str:
    """`auto`: the chat template when the tokenizer has one (an instruct model), else
    the tutorial's format."""
    if requested not in PROMPT_FORMATS:
        raise DataError(f"--prompt-format {requested!r}: choose one of {', '.join(PROMPT_FORMATS)}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if requested == "chat" and not has_template:
        raise DataError("--prompt-format chat: this tokenizer has no chat template; use --prompt-format tutorial")
    if requested == "auto":
        return "chat" if has_template else "tutorial"
    return requested


# --------------------------------------------------------------------------- conversations


def conversations(rows, dataset_format: str) -> list[list[dict]]:
    """Every row as a list of `{role, content}` turns (dolly and prompt/completion become
    one user turn and one assistant turn)."""
    if dataset_format == "messages":
        out = []
        for index, turns in enumerate(rows["messages"]):
            if not isinstance(turns, list) or not all(isinstance(t, dict) and "role" in t and "content" in t
                                                      for t in turns):
                raise DataError(f"row {index}: 'messages' must be a list of {{role, content}} objects")
            out.append([{"role": str(t["role"]), "content": str(t["content"] or "")} for t in turns])
        return out
    if dataset_format == "prompt-completion":
        return [[{"role": "user", "content": p or ""}, {"role": "assistant", "content": (c or "").strip()}]
                for p, c in zip(rows["prompt"], rows["completion"])]
    contexts = rows["context"] if "context" in rows.column_names else [""] * len(rows)
    return [[{"role": "user", "content": (f"{i or ''}\n\n{c}" if c and c.strip() else (i or ""))},
             {"role": "assistant", "content": (r or "").strip()}]
            for i, c, r in zip(rows["instruction"], contexts, rows["response"])]


def tutorial_pieces(turns: list[dict], dolly_row: tuple[str, str] | None) -> list[tuple[str, bool]]:
    """(text, is_label) pieces in the tutorial's format; one exchange only."""
    if [t["role"] for t in turns] != ["user", "assistant"]:
        raise DataError("--prompt-format tutorial takes one user turn and one assistant turn per example; "
                        "multi-turn or system messages need --prompt-format chat")
    prompt = format_prompt(*dolly_row) if dolly_row else format_prompt(turns[0]["content"], "")
    return [(prompt, False), (" " + turns[1]["content"], True)]


def chat_pieces(tokenizer, turns: list[dict]) -> list[tuple[str, bool]]:
    """(text, is_label) pieces from the chat template: each assistant turn (with the
    template's end-of-turn marker) is a label piece, everything else is context. Built
    from prefix renders, so it holds for any template that renders a conversation as
    the concatenation of its turns."""
    def render(part: list[dict], prompt: bool) -> str:
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)

    pieces, done = [], ""
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before, after = render(turns[:i], True), render(turns[:i + 1], False)
        if not before.startswith(done) or not after.startswith(before):
            raise DataError("the tokenizer's chat template does not render a conversation as a prefix of its "
                            "continuation, so assistant turns cannot be labelled; use --prompt-format tutorial")
        pieces += [(before[len(done):], False), (after[len(before):], True)]
        done = after
    if not pieces:
        raise DataError("an example has no assistant turn to learn from")
    return pieces


@dataclass
class Encoded:
    input_ids: list[list[int]]
    labels: list[list[int]]
    skipped_long_prompts: list[int]  # row indices whose prompt leaves no room for a response
    truncated: int                   # rows whose response was cut at max_seq_len


def encode_rows(rows, tokenizer, max_seq_len: int, prompt_format: str = "tutorial",
                dataset_format: str = "auto") -> Encoded:
    """Tokenize every row; only assistant tokens carry labels."""
    dataset_format = detect_format(list(rows.column_names), "rows", dataset_format)
    prompt_format = resolve_prompt_format(prompt_format, tokenizer)
    turns = conversations(rows, dataset_format)
    if prompt_format == "chat":
        pieces = [chat_pieces(tokenizer, t) for t in turns]
        bos = []  # the template writes its own <bos>
    else:
        dolly = None
        if dataset_format == "dolly":
            contexts = rows["context"] if "context" in rows.column_names else [""] * len(rows)
            dolly = list(zip([i or "" for i in rows["instruction"]], contexts))
        pieces = [tutorial_pieces(t, dolly[k] if dolly else None) for k, t in enumerate(turns)]
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if prompt_format == "tutorial" and tokenizer.eos_token_id is not None else []
    flat = [text for p in pieces for text, _ in p]
    ids = iter(tokenizer(flat, add_special_tokens=False)["input_ids"])
    out = Encoded([], [], [], 0)
    for index, example in enumerate(pieces):
        tokens, labels = list(bos), [IGNORE_INDEX] * len(bos)
        for _, is_label in example:
            piece = next(ids)
            tokens += piece
            labels += piece if is_label else [IGNORE_INDEX] * len(piece)
        tokens, labels = tokens + eos, labels + eos
        first_label = next((k for k, x in enumerate(labels) if x != IGNORE_INDEX), len(labels))
        if first_label >= max_seq_len:
            out.skipped_long_prompts.append(index)
            continue
        if len(tokens) > max_seq_len:
            tokens, labels = tokens[:max_seq_len], labels[:max_seq_len]
            out.truncated += 1
        out.input_ids.append(tokens)
        out.labels.append(labels)
    return out


# --------------------------------------------------------------------------- packing


@dataclass
class Packed:
    """Fixed-shape blocks: arrays of [num_blocks, max_seq_len], plus per-block counts."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray   # 1, 2, … per example in the block; padding has its own id
    real_tokens: np.ndarray   # non-padding tokens per block
    label_tokens: np.ndarray  # tokens that are predicted and scored (labels[1:] != -100)

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
    seg = np.zeros(shape, dtype=np.int64)
    real = np.zeros(len(blocks), dtype=np.int64)
    for b, members in enumerate(blocks):
        at = 0
        for k, i in enumerate(sorted(members), start=1):
            n = len(input_ids[i])
            ids[b, at:at + n] = input_ids[i]
            labs[b, at:at + n] = labels[i]
            pos[b, at:at + n] = np.arange(n)
            seg[b, at:at + n] = k
            at += n
        real[b] = at
        pos[b, at:] = np.arange(max_seq_len - at)  # padding is its own "document"
        seg[b, at:] = len(members) + 1
    scored = (labs[:, 1:] != IGNORE_INDEX).sum(axis=1).astype(np.int64)
    return Packed(ids, labs, pos, seg, real, scored)


@dataclass
class PreparedData:
    train: Packed
    eval: Packed | None
    examples: int
    eval_examples: int
    skipped_long_prompts: int
    truncated: int
    dataset_format: str = "dolly"
    prompt_format: str = "tutorial"


def split_eval(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    if eval_fraction <= 0:
        return list(range(n)), []
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = max(1, int(round(n * eval_fraction)))
    if held >= n:
        raise DataError(f"--eval-fraction {eval_fraction} leaves no training examples out of {n}")
    return sorted(order[held:]), sorted(order[:held])


def pad_id_of(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def prepare(dataset: str, split: str, tokenizer, max_seq_len: int, eval_fraction: float, seed: int,
            long_prompts: str = "skip", prompt_format: str = "auto", dataset_format: str = "auto") -> PreparedData:
    rows = load_rows(dataset, split)
    dataset_format = validate_rows(rows, dataset, split, dataset_format)
    prompt_format = resolve_prompt_format(prompt_format, tokenizer)
    enc = encode_rows(rows, tokenizer, max_seq_len, prompt_format, dataset_format)
    if enc.skipped_long_prompts and (long_prompts == "fail" or not enc.input_ids):
        first = enc.skipped_long_prompts[0]
        raise DataError(f"{len(enc.skipped_long_prompts)} of {len(rows)} examples have a prompt longer than "
                        f"--max-seq-len={max_seq_len} tokens (first: row {first}); raise --max-seq-len"
                        + (" or pass --long-prompts skip" if long_prompts == "fail" else ""))
    train_idx, eval_idx = split_eval(len(enc.input_ids), eval_fraction, seed)
    pad_id = pad_id_of(tokenizer)

    def pack_subset(index: list[int]) -> Packed:
        return pack([enc.input_ids[i] for i in index], [enc.labels[i] for i in index], max_seq_len, pad_id)

    return PreparedData(train=pack_subset(train_idx), eval=pack_subset(eval_idx) if eval_idx else None,
                        examples=len(train_idx), eval_examples=len(eval_idx),
                        skipped_long_prompts=len(enc.skipped_long_prompts), truncated=enc.truncated,
                        dataset_format=dataset_format, prompt_format=prompt_format)


# --------------------------------------------------------------------------- order


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is split: `accum` micro-batches of
    `per_device` blocks on each of `world` devices."""

    world: int
    per_device: int
    accum: int

    @property
    def global_blocks(self) -> int:
        return self.world * self.per_device * self.accum


def epoch_permutation(num_blocks: int, epoch: int, seed: int) -> np.ndarray:
    """The epoch's block order, the same on every rank (and after a resume)."""
    return np.random.default_rng(seed + epoch).permutation(num_blocks)


def steps_per_epoch(num_blocks: int, plan: BatchPlan) -> int:
    """Whole global batches only (static shapes: no ragged last batch)."""
    return num_blocks // plan.global_blocks


def step_blocks(order: np.ndarray, step: int, plan: BatchPlan, rank: int) -> np.ndarray:
    """[accum, per_device] block indices of `rank` for optimizer step `step` (from 0).
    Step s takes order[s*G:(s+1)*G]; ranks stride it, so a step's blocks do not depend
    on the world size and a resumed run starts the next step exactly where it stopped."""
    g = plan.global_blocks
    chunk = order[step * g:(step + 1) * g]
    return chunk[rank::plan.world].reshape(plan.accum, plan.per_device)


def global_label_tokens(packed: Packed, order: np.ndarray, step: int, plan: BatchPlan) -> int:
    """Label tokens in the whole global batch of a step: the loss's denominator, known on
    the host from the numpy arrays, so no device value is read to compute it."""
    g = plan.global_blocks
    return int(packed.label_tokens[order[step * g:(step + 1) * g]].sum())


def shard_order(num_blocks: int, world_size: int, batch_size: int, epoch: int, seed: int,
                rank: int, shuffle: bool = True) -> np.ndarray:
    """This rank's block indices for one epoch (one micro-batch per step), cut to whole
    global batches."""
    order = epoch_permutation(num_blocks, epoch, seed) if shuffle else np.arange(num_blocks)
    plan = BatchPlan(world_size, batch_size, 1)
    steps = steps_per_epoch(num_blocks, plan)
    return np.concatenate([step_blocks(order, s, plan, rank).ravel() for s in range(steps)] or [np.zeros(0, int)])


def eval_order(num_blocks: int, world_size: int, batch_size: int, rank: int) -> np.ndarray:
    """Every eval block exactly once; -1 marks filler so every rank runs the same number
    of same-shaped batches (filler blocks carry no labels)."""
    per_step = world_size * batch_size
    total = -(-num_blocks // per_step) * per_step
    order = np.full(total, -1, dtype=np.int64)
    order[:num_blocks] = np.arange(num_blocks)
    return order[rank::world_size]
