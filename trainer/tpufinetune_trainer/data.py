"""Training data: load, recognise the format, render prompts, tokenize, pack into blocks.

Formats (`--dataset-format`): dolly (`instruction`, optional `context`, `response`),
`messages` (a list of `{role, content}` turns) and `prompt`/`completion`; `preference`
(`chosen`/`rejected`, with a `prompt` or as conversations) is `--method dpo`'s (preference.py). Prompt formats
(`--prompt-format`): `chat` renders every example with the tokenizer's own chat template
(what an instruct model such as gemma-4-E2B-it was trained on), `tutorial` is the
tutorial's ``Instruction: …\\nResponse: …``. Labels (`--loss-on`): `responses` labels the
assistant turns only (-100 everywhere else), so the loss measures answers, never prompts
or padding; `all` labels every token of the example but its first, prompt included, as the
tutorial's DataCollatorForLanguageModeling does.

Steps and static shapes: an optimizer step takes the tutorial's batch of examples
(`BatchPlan`); each epoch groups the seeded shuffle into steps (`epoch_steps`) and packs
each step's examples (best fit) into blocks of exactly ``max_seq_len`` tokens, a fixed
number per device for the whole run (`plan_run`, `plan_epoch`). Each block
carries segment ids (one per example, padding is its own segment) and position ids that
restart at 0 for every example; the trainer turns the segment ids into block-diagonal
attention masks, so an example only attends to itself and sees the positions it would see
alone. Every example's first token is unlabelled (a prompt token, label -100), so no
label ever crosses a boundary.

Loading and tokenizing run in the driver (once), a chunk of rows at a time into files on
the host's disk that workers map (data_stream.py); workers receive the token rows and
plan and pack the epochs themselves (the same on every rank: it is a pure function of
the lengths, the plan and the seed): the run's static maxima up front in one pass
(`plan_run`), each epoch's plan when the loop reaches it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import storage
from .errors import DataError

IGNORE_INDEX = -100
DATASET_FORMATS = ("auto", "dolly", "messages", "prompt-completion", "preference")
PROMPT_FORMATS = ("auto", "chat", "tutorial")
LOSS_ON = ("responses", "all")
COLUMNS = {"dolly": ("instruction", "response"), "messages": ("messages",),
           "prompt-completion": ("prompt", "completion"),
           "preference": ("chosen", "rejected")}  # --method dpo (preference.py)
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
    for name in ("preference", "messages", "prompt-completion", "dolly"):
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
            refuse_media_parts(turns, index)
            out.append([{"role": str(t["role"]), "content": str(t["content"] or "")} for t in turns])
        return out
    if dataset_format == "prompt-completion":
        return [[{"role": "user", "content": p or ""}, {"role": "assistant", "content": (c or "").strip()}]
                for p, c in zip(rows["prompt"], rows["completion"])]
    contexts = rows["context"] if "context" in rows.column_names else [""] * len(rows)
    return [[{"role": "user", "content": (f"{i or ''}\n\n{c}" if c and c.strip() else (i or ""))},
             {"role": "assistant", "content": (r or "").strip()}]
            for i, c, r in zip(rows["instruction"], contexts, rows["response"])]


def refuse_media_parts(turns: list[dict], index: int) -> None:
    """A text run given a content list with an image or audio part (media.py renders those,
    with --vision-tower): refused naming the row, not rendered as the list's text."""
    kinds = {part.get("type") for turn in turns if isinstance(turn["content"], list)
             for part in turn["content"] if isinstance(part, dict)}
    if "audio" in kinds:
        raise DataError(f"row {index}: an audio part: audio fine-tuning is not built yet; remove the audio parts")
    if "image" in kinds:
        raise DataError(f"row {index}: an image part, but the run has no vision tower: pass --vision-tower frozen "
                        "(spec.training.towers.vision) to train on images, or remove the image parts")


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
                dataset_format: str = "auto", loss_on: str = "responses") -> Encoded:
    """Tokenize every row; only assistant tokens carry labels, or (loss_on "all") every
    token but the first."""
    if loss_on not in LOSS_ON:
        raise DataError(f"--loss-on {loss_on!r}: choose one of {', '.join(LOSS_ON)}")
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
        if loss_on == "all":  # the first stays unlabelled: in a packed block it is the previous example's target
            labels = [IGNORE_INDEX] + tokens[1:]
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


def bin_pack(lengths: list[int] | np.ndarray, max_seq_len: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing: lists of indices into `lengths` whose lengths sum
    to at most `max_seq_len`, the fewest bins this heuristic finds (deterministic)."""
    return steps_bins(lengths, [np.arange(len(lengths))], max_seq_len)[0]


def longest_first(lengths: np.ndarray) -> np.ndarray:
    """Positions (along the last axis) by decreasing length, ties in position order."""
    return np.argsort(-lengths, axis=-1, kind="stable")


def best_fit(items: list[int], needs: list[int], capacity: int) -> list[list[int]]:
    """`items`, longest first, each into the open bin with the least room that holds it
    (the first opened on a tie), or a new bin. Bins are kept as sorted keys `room * span +
    bin`: one int compares faster than a tuple."""
    if sum(needs) <= capacity:  # every item fits the first bin
        return [list(items)] if items else []
    span = len(items) + 1  # more than any bin index
    # Items over half the capacity fit no bin opened before them (each holds one as long).
    opened = bisect.bisect_left(needs, -(capacity // 2), key=operator.neg)
    bins = [[item] for item in items[:opened]]
    keys = [(capacity - need) * span + b for b, need in enumerate(needs[:opened])]  # sorted: needs decrease
    find, insort = bisect.bisect_left, bisect.insort
    for item, need in zip(items[opened:], needs[opened:]):
        at = find(keys, need * span)  # the first bin with room >= need
        if at == len(keys):
            insort(keys, (capacity - need) * span + len(bins))
            bins.append([item])
        else:
            key = keys.pop(at)
            bins[key % span].append(item)
            insort(keys, key - need * span)
    return bins


def fill_blocks(input_ids: list, labels: list, blocks: list[list[int]], max_seq_len: int, pad_id: int) -> Packed:
    """Blocks of exactly `max_seq_len` tokens: block b holds the examples `blocks[b]` (in
    index order), then padding (no labels). An empty list is an all-padding block."""
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


def pack(input_ids: list[list[int]], labels: list[list[int]], max_seq_len: int, pad_id: int) -> Packed:
    """Best-fit-decreasing bin packing of examples into blocks of `max_seq_len` tokens."""
    return fill_blocks(input_ids, labels, bin_pack([len(x) for x in input_ids], max_seq_len), max_seq_len, pad_id)


class Ragged:
    """Rows of different lengths (token ids, or labels) in one flat int32 array with the
    rows' offsets: 4 bytes a token where a list of Python ints costs about 36, and two
    buffers that Ray's object store hands to every worker of a host without a copy (the
    driver puts the examples there once), where lists were rebuilt in each worker. Row `i`
    is a read-only view. The arrays may be maps of files (data_stream.MappedRagged): what
    reads every token reads a part at a time (`parts`)."""

    __slots__ = ("values", "offsets")

    def __init__(self, values: np.ndarray, offsets: np.ndarray):
        self.values, self.offsets = values, offsets

    @classmethod
    def of(cls, rows) -> "Ragged":
        lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.fromiter((token for row in rows for token in row), dtype=np.int32, count=int(offsets[-1]))
        return cls(values, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def parts(self, tokens: int = 1 << 22):
        """The values, `tokens` at a time (views): to read them all in bounded memory."""
        for start in range(0, len(self.values), tokens):
            yield self.values[start:start + tokens]


@dataclass
class Examples:
    """Tokenized training examples, not yet packed: packing happens per optimizer step,
    from the epoch's seeded order (`plan_epoch`). Token ids and labels as `Ragged` rows
    (lists of rows are converted). `digest`: their `examples_digest`, computed once where
    they are prepared (data.prepare; a streamed cache entry keeps it in its meta.json) and
    carried with them to the workers, which then never read every token to learn it."""

    input_ids: Ragged
    labels: Ragged
    digest: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.input_ids, Ragged):
            self.input_ids = Ragged.of(self.input_ids)
        if not isinstance(self.labels, Ragged):
            self.labels = Ragged.of(self.labels)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> np.ndarray:
        return self.input_ids.lengths

    @property
    def label_tokens(self) -> np.ndarray:
        """Scored tokens per example: labels past its first token (every example starts
        with an unlabelled prompt token, so this is what its block counts for it)."""
        offsets, counts = self.labels.offsets, np.zeros(len(self), dtype=np.int64)
        rows = np.flatnonzero(self.labels.lengths > 0)  # reduceat needs no empty segment
        # A part of the rows at a time: reduceat sums an int64 copy of all it is given.
        for part in np.array_split(rows, max(1, len(self.labels.values) // LABEL_COUNT_TOKENS)):
            if part.size:
                first, starts = offsets[part[0]], offsets[part] - offsets[part[0]]
                scored = self.labels.values[first:offsets[part[-1] + 1]] != IGNORE_INDEX
                scored[starts] = False
                counts[part] = np.add.reduceat(scored, starts, dtype=np.int64)
        return counts


# Tokens whose labels Examples.label_tokens counts at a time.
LABEL_COUNT_TOKENS = 1 << 20


def hash_examples(examples: Examples) -> str:
    """The tokenized training examples, as a short digest (the resume fingerprint's
    `train_examples`): another dataset, split, tokenizer or prompt rendering gives another.
    Reads every token (as int64: the bytes runs hashed when the rows were lists), a part at
    a time; `examples_digest` reads it from the examples once computed."""
    import hashlib

    digest = hashlib.blake2b(digest_size=8)
    digest.update(examples.lengths.tobytes())
    for rows in (examples.input_ids, examples.labels):
        for part in (rows.parts() if len(rows) else ()):
            digest.update(part.astype(np.int64).tobytes())
    return f"{len(examples)} examples, digest {digest.hexdigest()}"


def examples_digest(examples: Examples) -> str:
    """The examples' digest: the one computed where they were prepared, else hashed now."""
    return examples.digest or hash_examples(examples)


def with_digest(examples: Examples, digest: str | None = None) -> Examples:
    """`examples` carrying their digest (`digest` when known, else hashed now, once)."""
    examples.digest = digest or hash_examples(examples)
    return examples


@dataclass
class PreparedData:
    train: Examples
    eval: Packed | None
    examples: int
    eval_examples: int
    skipped_long_prompts: int
    truncated: int
    dataset_format: str = "dolly"
    prompt_format: str = "tutorial"
    source: str = "tokenized"  # or where a streamed prepare found them (data_stream.ensure)

    @property
    def tokenized_examples(self) -> int:
        """Rows tokenized by this prepare: none when the examples were found prepared."""
        return self.examples + self.eval_examples + self.skipped_long_prompts if self.source == "tokenized" else 0


def held_out(n: int, eval_fraction: float, seed: int) -> np.ndarray:
    """The held-out examples' indices, sorted: the first `eval_fraction` of a seeded shuffle
    (`random.shuffle` on an int64 array makes the calls it makes on a list, so the split is
    the one runs made when it shuffled a list), 8 bytes an example."""
    if eval_fraction <= 0:
        return np.zeros(0, dtype=np.int64)
    order = np.arange(n, dtype=np.int64)
    random.Random(seed).shuffle(order)
    held = max(1, int(round(n * eval_fraction)))
    if held >= n:
        raise DataError(f"--eval-fraction {eval_fraction} leaves no training examples out of {n}")
    return np.sort(order[:held])


def split_eval(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    held = held_out(n, eval_fraction, seed)
    kept = np.ones(n, dtype=bool)
    kept[held] = False
    return np.flatnonzero(kept).tolist(), held.tolist()


def pad_id_of(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def check_long_prompts(skipped: int, read: int, first: int | None, kept: int, max_seq_len: int,
                       long_prompts: str, complete: bool = True) -> None:
    """Refuse the data when a prompt had to be skipped for its length and --long-prompts is
    `fail`, or when no example is left; `first` is the first skipped row's index. When the
    reading stopped at the first such prompt (`complete` False), the counts are those of
    the rows read."""
    if skipped and (long_prompts == "fail" or not kept):
        of = f"the first {read}" if not complete else f"{read}"
        raise DataError(f"{skipped} of {of} examples have a prompt longer than --max-seq-len={max_seq_len} "
                        f"tokens (first: row {first}); raise --max-seq-len"
                        + (" or pass --long-prompts skip" if long_prompts == "fail" else ""))


def prepare(dataset: str, split: str, tokenizer, max_seq_len: int, eval_fraction: float, seed: int,
            long_prompts: str = "skip", prompt_format: str = "auto", dataset_format: str = "auto",
            loss_on: str = "responses", stream: bool = True, cache_dir: str | Path | None = None,
            published: str | None = None) -> PreparedData:
    """The training examples (tokenized, not packed) and the held-out ones (packed).
    `stream` (the default) tokenizes a chunk of rows at a time into this host's cache
    (`cache_dir`, else data_stream.cache_root()) and maps the files, so neither the text
    nor the tokens need to fit in memory (data_stream.py); otherwise every row is
    tokenized in memory. Both give the same examples. `published`: the run's folder of
    published entries (data_stream.run_data_uri), looked in before tokenizing."""
    rows = load_rows(dataset, split)
    dataset_format = validate_rows(rows, dataset, split, dataset_format)
    if dataset_format == "preference":
        raise DataError(f"--dataset {dataset} is preference data ('chosen' and 'rejected' columns): train it with "
                        "--method dpo, or give supervised data (dolly, messages or prompt/completion)")
    prompt_format = resolve_prompt_format(prompt_format, tokenizer)
    if stream:
        from . import data_stream

        return data_stream.prepare(rows, dataset, split, tokenizer, max_seq_len, eval_fraction, seed, long_prompts,
                                   prompt_format, dataset_format, loss_on, cache_dir, published)
    enc = encode_rows(rows, tokenizer, max_seq_len, prompt_format, dataset_format, loss_on)
    skipped = enc.skipped_long_prompts
    check_long_prompts(len(skipped), len(rows), skipped[0] if skipped else None, len(enc.input_ids), max_seq_len,
                       long_prompts)
    train_idx, eval_idx = split_eval(len(enc.input_ids), eval_fraction, seed)
    pad_id = pad_id_of(tokenizer)

    def pack_subset(index: list[int]) -> Packed:
        return pack([enc.input_ids[i] for i in index], [enc.labels[i] for i in index], max_seq_len, pad_id)

    # Training examples are packed per step, from each epoch's order (plan_epoch); the
    # evaluation's once, here.
    train = with_digest(Examples([enc.input_ids[i] for i in train_idx], [enc.labels[i] for i in train_idx]))
    return PreparedData(train=train, eval=pack_subset(eval_idx) if eval_idx else None,
                        examples=len(train_idx), eval_examples=len(eval_idx),
                        skipped_long_prompts=len(enc.skipped_long_prompts), truncated=enc.truncated,
                        dataset_format=dataset_format, prompt_format=prompt_format)


# --------------------------------------------------------------------------- order


@dataclass(frozen=True)
class BatchPlan:
    """One optimizer step: `world` devices x `per_device` examples x `accum` micro-batches
    (the tutorial's batch: examples, not blocks). The step's examples are packed into
    blocks, dealt out as `accum` micro-batches of `blocks` blocks on each device; `blocks`
    is fixed for the whole run (static shapes) and known up front (`plan_run`).

    With `tokens_per_step` (--tokens-per-step, MaxText's way) a step is a fixed number of
    token positions instead: `world` x `blocks` (= `per_device`) blocks x `accum`, full
    blocks, whatever number of examples they hold (pack_token_epoch)."""

    world: int
    per_device: int
    accum: int
    blocks: int = 1
    tokens_per_step: int = 0

    @property
    def global_examples(self) -> int:
        return self.world * self.per_device * self.accum

    @property
    def global_blocks(self) -> int:
        return self.world * self.accum * self.blocks


def epoch_permutation(num_examples: int, epoch: int, seed: int) -> np.ndarray:
    """The epoch's example order, the same on every rank (and after a resume)."""
    return np.random.default_rng(seed + epoch).permutation(num_examples)


def steps_per_epoch(num_examples: int, plan: BatchPlan) -> int:
    """Every example once per epoch: the last step takes what is left (fewer examples in
    the same blocks). Where the examples fill whole steps this is the tutorial's count
    (its DataLoader drops a partial last batch instead)."""
    return -(-num_examples // plan.global_examples)


def epoch_step_count(lengths: np.ndarray, plan: BatchPlan) -> int:
    """Optimizer steps per epoch: every example once (steps_per_epoch), or with
    --tokens-per-step the steps the data's tokens fill (the blocks packing needs beyond
    them, a few percent, are left for other epochs' shuffles: every step is full)."""
    if not plan.tokens_per_step:
        return steps_per_epoch(len(lengths), plan)
    tokens = int(np.asarray(lengths, dtype=np.int64).sum())
    if tokens < plan.tokens_per_step:
        raise DataError(f"the training examples hold {tokens} tokens, fewer than one step's --tokens-per-step "
                        f"{plan.tokens_per_step} (spec.training.tokensPerStep); lower it or give the run more data")
    return tokens // plan.tokens_per_step


# Steps whose examples are grouped together to even out their tokens (epoch_steps).
BALANCE_WINDOW_STEPS = 16


def epoch_steps(lengths: np.ndarray, plan: BatchPlan, epoch: int, seed: int) -> list[np.ndarray]:
    """Each optimizer step's examples in epoch `epoch`: the seeded shuffle, cut into
    windows of BALANCE_WINDOW_STEPS steps' worth of examples; inside a window the longest
    example goes first, each to the step with the fewest tokens so far that still has room
    (`plan.global_examples` examples, the last step of the epoch what is left), and the
    window's steps are then taken in a seeded order. So every step has the tutorial's
    number of examples, a random mix of them, and about the same number of tokens, which
    keeps the fixed blocks per step nearly full (the fullest step sets them for the run).
    Depends only on the lengths, the plan and the seed: every rank, and a resumed run, get
    the same steps."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = epoch_permutation(len(lengths), epoch, seed)
    size, steps = plan.global_examples, steps_per_epoch(len(lengths), plan)
    rng = np.random.default_rng([seed, epoch])
    window = BALANCE_WINDOW_STEPS * size
    whole = len(order) // window if len(order) >= DEAL_TOGETHER * window else 0  # windows dealt together
    dealt = deal_windows(order[:whole * window].reshape(whole, window), lengths, size)
    out = [step for members in dealt for step in members[rng.permutation(BALANCE_WINDOW_STEPS)]]
    for first in range(whole * BALANCE_WINDOW_STEPS, steps, BALANCE_WINDOW_STEPS):  # the others, one by one
        count = min(steps, first + BALANCE_WINDOW_STEPS) - first
        pool = order[first * size:(first + count) * size]
        pool, room = pool[longest_first(lengths[pool])], [size] * (count - 1) + [len(pool) - (count - 1) * size]
        members = deal_window(pool.tolist(), lengths[pool].tolist(), room)
        out += [np.sort(np.array(members[k], dtype=np.int64)) for k in rng.permutation(count)]
    return out


# Windows of full steps dealt together (deal_windows) where there are at least this many:
# a numpy pass per place costs about what dealing this many windows one by one does.
DEAL_TOGETHER = 32


def deal_window(items: list[int], needs: list[int], room: list[int]) -> list[list[int]]:
    """`items` (longest first) each to the step with the fewest tokens so far that still
    has room (`room[k]` examples), the first step on a tie: the heap's `tokens * steps + k`."""
    steps, members = len(room), [[] for _ in room]
    heap = list(range(steps))
    for item, need in zip(items, needs):
        k = heap[0] % steps
        members[k].append(item)
        if len(members[k]) < room[k]:
            heapq.heapreplace(heap, heap[0] + need * steps)
        else:
            heapq.heappop(heap)
    return members


def deal_windows(pools: np.ndarray, lengths: np.ndarray, size: int) -> np.ndarray:
    """deal_window for windows of full steps (rows of `pools`), all windows a place at a
    time: [windows, steps, size] examples, each step's sorted."""
    pools = np.take_along_axis(pools, longest_first(lengths[pools]), axis=1)
    needs = lengths[pools]
    tokens = np.zeros((len(pools), BALANCE_WINDOW_STEPS), dtype=np.int64)
    taken = np.zeros_like(tokens)
    step = np.empty_like(pools)
    rows = np.arange(len(pools))
    for place in range(pools.shape[1] if len(pools) else 0):
        k = np.where(taken < size, tokens, np.iinfo(np.int64).max).argmin(axis=1)  # argmin: the first on a tie
        step[:, place] = k
        tokens[rows, k] += needs[:, place]
        taken[rows, k] += 1
    members = np.sort(step * (len(lengths) + 1) + pools, axis=1) % (len(lengths) + 1)  # by step, then example
    return members.reshape(len(pools), BALANCE_WINDOW_STEPS, size)


def steps_bins(lengths: np.ndarray, steps: list[np.ndarray], max_seq_len: int) -> list[list[list[int]]]:
    """Each step's examples packed into the fewest blocks (example indices per block): best
    fit, the longest first (ties in the step's order; every step sorted at once)."""
    lengths, sizes = np.asarray(lengths, dtype=np.int64), [len(examples) for examples in steps]
    flat = np.concatenate(steps).astype(np.int64) if steps else np.zeros(0, dtype=np.int64)
    flat = flat[np.lexsort((-lengths[flat], np.repeat(np.arange(len(steps)), sizes)))]  # stable
    items, needs, ends = flat.tolist(), lengths[flat].tolist(), np.cumsum(sizes).tolist()
    return [best_fit(items[end - n:end], needs[end - n:end], max_seq_len) for n, end in zip(sizes, ends)]


class EpochBlocks(NamedTuple):
    """An epoch's steps and their blocks, step after step (`per_step[s]` are step s's)."""

    steps: list[np.ndarray]
    blocks: list[list[int]]
    per_step: np.ndarray


# --tokens-per-step: steps' worth of tokens packed together (pack_token_epoch).
TOKEN_WINDOW_STEPS = 16


def pack_token_epoch(lengths: np.ndarray, plan: BatchPlan, epoch: int, seed: int, max_seq_len: int) -> EpochBlocks:
    """--tokens-per-step: the epoch's seeded shuffle cut into windows of TOKEN_WINDOW_STEPS
    steps' worth of tokens, each window packed best fit (the longest first) and its blocks
    taken in a seeded order; the first epoch_step_count x global_blocks blocks make the
    steps, global_blocks each, all of them full blocks. Depends only on the lengths, the
    plan and the seed: every rank, and a resumed run, get the same steps."""
    lengths = np.asarray(lengths, dtype=np.int64)
    steps, size = epoch_step_count(lengths, plan), plan.global_blocks
    order = epoch_permutation(len(lengths), epoch, seed)
    rng = np.random.default_rng([seed, epoch, 1])
    window = np.cumsum(lengths[order]) // (TOKEN_WINDOW_STEPS * plan.tokens_per_step)
    cuts = np.flatnonzero(np.diff(window)) + 1
    blocks: list[list[int]] = []
    for pool in np.split(order, cuts):
        pool = pool[longest_first(lengths[pool])]
        packed = best_fit(pool.tolist(), lengths[pool].tolist(), max_seq_len)
        blocks += [packed[k] for k in rng.permutation(len(packed))]
        if len(blocks) >= steps * size:
            break
    blocks = blocks[:steps * size]
    members = [np.sort(np.fromiter(itertools.chain.from_iterable(blocks[s * size:(s + 1) * size]), dtype=np.int64))
               for s in range(steps)]
    return EpochBlocks(members, blocks, np.full(steps, size, dtype=np.int64))


def pack_epoch(lengths: np.ndarray, plan: BatchPlan, epoch: int, seed: int, max_seq_len: int) -> EpochBlocks:
    """The epoch's steps, each packed into the fewest blocks (the plan's `blocks` unused;
    with --tokens-per-step, pack_token_epoch's full steps)."""
    if plan.tokens_per_step:
        return pack_token_epoch(lengths, plan, epoch, seed, max_seq_len)
    steps = epoch_steps(lengths, plan, epoch, seed)
    bins = steps_bins(lengths, steps, max_seq_len)
    per_step = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))
    return EpochBlocks(steps, list(itertools.chain.from_iterable(bins)), per_step)


def sums_of(per_example: np.ndarray, groups: list) -> np.ndarray:
    """Exact int64 sums of `per_example` over each (non-empty) group of example indices
    (arrays, or lists)."""
    if not groups:
        return np.zeros(0, dtype=np.int64)
    sizes = np.fromiter(map(len, groups), dtype=np.int64, count=len(groups))
    flat = np.concatenate(groups) if isinstance(groups[0], np.ndarray) else \
        np.fromiter(itertools.chain.from_iterable(groups), dtype=np.int64, count=int(sizes.sum()))
    return np.add.reduceat(np.asarray(per_example, dtype=np.int64)[flat], np.cumsum(sizes) - sizes)


def block_places(per_step: np.ndarray, plan: BatchPlan) -> tuple[np.ndarray, ...]:
    """(step, micro-batch, rank, place in the micro-batch) of every block, in order: block
    j of a step goes to rank j % world, its (j // world)-th place there."""
    step = np.repeat(np.arange(len(per_step)), per_step)
    j = np.arange(len(step)) - np.repeat(np.cumsum(per_step) - per_step, per_step)
    place = j // plan.world
    return step, place // plan.blocks, j % plan.world, place % plan.blocks


@dataclass(frozen=True)
class RunShape:
    """What the run's static shapes need, known before its first step: the plan with its
    blocks per device, and the most label tokens of any micro-batch of any rank in any
    epoch (the loss head's cap: what `rank_blocks` of every epoch's plan hold at most)."""

    plan: BatchPlan
    most_label_tokens: int


def plan_run(lengths: np.ndarray, label_tokens: np.ndarray, base: BatchPlan, epochs: int, seed: int,
             max_seq_len: int) -> RunShape:
    """Both whole-run maxima in one pass over the epochs, one epoch's blocks at a time and
    no epoch's plan kept. Which blocks share a micro-batch depends on the blocks per
    device, known only after the last epoch, so the label maximum is kept for each value
    they can take (at most `per_device`: a block holds at least one example)."""
    most_blocks, most_labels = 1, np.zeros(base.per_device + 1, dtype=np.int64)
    for epoch in range(1, epochs + 1):
        fullest, labels = epoch_maxima(lengths, label_tokens, base, epoch, seed, max_seq_len)
        most_blocks, most_labels = max(most_blocks, fullest), np.maximum(most_labels, labels)
    plan = replace(base, blocks=-(-most_blocks // (base.world * base.accum)))
    return RunShape(plan, int(most_labels[plan.blocks]))


def epoch_maxima(lengths: np.ndarray, label_tokens: np.ndarray, base: BatchPlan, epoch: int, seed: int,
                 max_seq_len: int) -> tuple[int, np.ndarray]:
    """The blocks of the epoch's fullest step, and the most label tokens of a micro-batch
    of one rank for each blocks per device that holds that step (0 for fewer)."""
    packed = pack_epoch(lengths, base, epoch, seed, max_seq_len)
    fullest = int(packed.per_step.max(initial=1))
    block_labels = sums_of(label_tokens, packed.blocks)
    most = np.zeros(base.per_device + 1, dtype=np.int64)
    for blocks in range(-(-fullest // (base.world * base.accum)), base.per_device + 1):
        most[blocks] = most_micro_batch(block_labels, packed.per_step, replace(base, blocks=blocks))
    return fullest, most


def most_micro_batch(block_values: np.ndarray, per_step: np.ndarray, plan: BatchPlan) -> int:
    """The largest sum of `block_values` over one micro-batch of one rank (0 with none)."""
    step, micro, rank, _ = block_places(per_step, plan)
    which = (step * plan.accum + micro) * plan.world + rank
    return int(np.bincount(which, weights=block_values).max(initial=0))  # float64: exact below 2**53


@dataclass
class EpochPlan:
    """One epoch's steps. `slots[s, a, r, k]` is the k-th block of rank r's micro-batch a
    in step s, an index into `blocks` (lists of example indices), or -1 for an
    all-padding block. `label_tokens` and `real_tokens` are each step's global counts."""

    blocks: list[list[int]]
    slots: np.ndarray
    label_tokens: np.ndarray
    real_tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.slots.shape[0])


def plan_epoch(lengths: np.ndarray, label_tokens: np.ndarray, plan: BatchPlan, epoch: int, seed: int,
               max_seq_len: int) -> EpochPlan:
    """The epoch's steps (epoch_steps), each packed into blocks: block j of a step goes
    to rank j % world, its (j // world)-th place there (micro-batch place // blocks), and
    the places left are all-padding blocks. Depends only on the data, the plan and the
    seed: every rank, and a resumed run, get the same steps."""
    packed = pack_epoch(lengths, plan, epoch, seed, max_seq_len)
    over = np.flatnonzero(packed.per_step > plan.global_blocks)
    if over.size:
        raise RuntimeError(f"epoch {epoch} step {over[0]} needs {packed.per_step[over[0]]} blocks, more than the "
                           f"plan's {plan.global_blocks}; the blocks per device must come from the same order (plan_run)")
    slots = np.full((len(packed.steps), plan.accum, plan.world, plan.blocks), -1, dtype=np.int64)
    slots[block_places(packed.per_step, plan)] = np.arange(len(packed.blocks))
    return EpochPlan(packed.blocks, slots, sums_of(label_tokens, packed.steps), sums_of(lengths, packed.steps))


def rank_blocks(examples: Examples, epoch: EpochPlan, rank: int, max_seq_len: int, pad_id: int,
                steps: slice = slice(None), fill=None) -> Packed:
    """Rank `rank`'s blocks of the epoch's `steps` (all by default), one per slot in step
    order ([steps * accum * blocks] blocks; a padding slot is an all-padding block): the
    window's step s's micro-batch a is blocks [(s * accum + a) * blocks, … + blocks). A
    window of steps holds that many steps' blocks in memory, whatever the dataset's size."""
    mine = epoch.slots[steps, :, rank, :].reshape(-1)
    blocks = [epoch.blocks[b] if b >= 0 else [] for b in mine]
    if fill is not None:  # the method's layout (DPO: each pair as two segments; methods/)
        return fill(examples, blocks, max_seq_len, pad_id)
    return fill_blocks(examples.input_ids, examples.labels, blocks, max_seq_len, pad_id)


def window_rows(index: np.ndarray, label_tokens: np.ndarray, size: int) -> np.ndarray:
    """A window's device table, [size, blocks per step + 1]: each step's block indices
    (`index`, [steps, blocks per step]), then its global label count; rows past the window's
    steps (a short last window, padded so that every window has one shape) index the filler
    block and count no labels, and no step takes them."""
    steps, per_step = index.shape
    rows = np.zeros((size, per_step + 1), dtype=np.int64)
    rows[steps:, :per_step] = steps * per_step  # the filler block's index
    rows[:steps, :per_step], rows[:steps, per_step] = index, label_tokens
    return rows


def eval_order(num_blocks: int, world_size: int, batch_size: int, rank: int) -> np.ndarray:
    """Every eval block exactly once; -1 marks filler so every rank runs the same number
    of same-shaped batches (filler blocks carry no labels)."""
    per_step = world_size * batch_size
    total = -(-num_blocks // per_step) * per_step
    order = np.full(total, -1, dtype=np.int64)
    order[:num_blocks] = np.arange(num_blocks)
    return order[rank::world_size]


def rank_eval_share(packed: Packed, world_size: int, batch_size: int, rank: int) -> tuple[Packed, np.ndarray]:
    """This rank's held-out blocks (those eval_order gives it) and its order over them:
    indices into the share, -1 for filler. A rank copies only its share to its device, a
    world-th of the held-out set, not all of it."""
    order = eval_order(len(packed), world_size, batch_size, rank)
    mine = order[order >= 0]
    share = type(packed)(**{name: getattr(packed, name)[mine] for name in type(packed).__dataclass_fields__})
    local = np.full(len(order), -1, dtype=np.int64)
    local[order >= 0] = np.arange(len(mine))
    return share, local
