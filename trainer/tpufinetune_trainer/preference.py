"""Preference data (`--method dpo`): pairs of a chosen and a rejected response to one prompt.

Formats, recognised by `--dataset-format auto` (or named `preference`) from the columns
`chosen` and `rejected`:

- standard: `prompt`, `chosen`, `rejected` as strings;
- conversational: `chosen` and `rejected` as lists of `{role, content}` turns; the prompt is
  the `prompt` column's turns when there is one, else the turns the two share from the
  start (TRL's implicit prompt); what follows it in each is the response.

The prompt is rendered once (the chat template's generation prompt, or the tutorial's
``Instruction: …\\nResponse:``) and tokenized once; each response is rendered as its
continuation. A pair is one item of the training data: its chosen sequence (prompt +
chosen) then its rejected one (prompt + rejected), `PairExamples`, planned and packed like
an SFT example (never split across blocks) and laid out by `fill_pair_blocks` as two
segments: segment 2k - 1 the k-th pair's chosen, 2k its rejected, positions restarting at
0 in each. Labels are on response tokens only.

Refused with the row's number (0-based, as `datasets` counts): a missing or non-text
field, an empty response, identical chosen and rejected, no shared prompt, and (per
`--long-prompts`) a prompt too long for the pair to fit one block of `--max-seq-len`. Held
in memory (not streamed: preference sets are small beside SFT corpora).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .data import IGNORE_INDEX, Examples, Packed, PreparedData, format_prompt, resolve_prompt_format, \
    split_eval, check_long_prompts, load_rows, detect_format, fill_blocks
from .errors import DataError

FORMAT = "preference"
COLUMNS = ("chosen", "rejected")


@dataclass
class PairExamples(Examples):
    """Tokenized pairs, each one row of `input_ids` / `labels`: its chosen sequence then
    its rejected one; `chosen_lengths[i]` is where pair i's rejected sequence starts.
    `reference` (optional, [pairs, 2] fp32): the reference model's summed response
    log-probabilities (chosen, rejected), computed once before training (full fine-tuning)."""

    chosen_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    reference: np.ndarray | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.chosen_lengths = np.asarray(self.chosen_lengths, dtype=np.int64)

    def subset(self, index) -> "PairExamples":
        index = list(index)
        return PairExamples([self.input_ids[i] for i in index], [self.labels[i] for i in index],
                            chosen_lengths=self.chosen_lengths[index],
                            reference=None if self.reference is None else self.reference[index])


def _text(value, row: int, name: str) -> str:
    if value is None:
        raise DataError(f"row {row}: the preference pair has no '{name}' (every row needs 'chosen' and "
                        "'rejected', and a 'prompt' unless they are conversations sharing one)")
    if not isinstance(value, str):
        raise DataError(f"row {row}: '{name}' must be text or a list of {{role, content}} turns, not "
                        f"{type(value).__name__}")
    return value


def _turns(value, row: int, name: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(t, dict) and "role" in t and "content" in t
                                              for t in value):
        raise DataError(f"row {row}: '{name}' must be a list of {{role, content}} turns")
    return [{"role": str(t["role"]), "content": str(t["content"] or "")} for t in value]


def pair_turns(prompt, chosen, rejected, row: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt turns, chosen response turns, rejected response turns) of one row, checked."""
    if chosen is None or rejected is None:
        _text(chosen if chosen is None else rejected, row, "chosen" if chosen is None else "rejected")
    if isinstance(chosen, list) or isinstance(rejected, list):
        chosen_turns, rejected_turns = _turns(chosen, row, "chosen"), _turns(rejected, row, "rejected")
        if prompt is not None:
            prompt_turns = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                            else _turns(prompt, row, "prompt"))
        else:
            shared = 0
            while (shared < min(len(chosen_turns), len(rejected_turns)) - 1
                   and chosen_turns[shared] == rejected_turns[shared]):
                shared += 1
            prompt_turns, chosen_turns, rejected_turns = (chosen_turns[:shared], chosen_turns[shared:],
                                                          rejected_turns[shared:])
            if not prompt_turns:
                raise DataError(f"row {row}: 'chosen' and 'rejected' share no prompt turns (and there is no "
                                "'prompt' column): give the conversation's prompt in both, or a 'prompt' field")
    else:
        prompt_turns = [{"role": "user", "content": _text(prompt, row, "prompt")}]
        chosen_turns = [{"role": "assistant", "content": _text(chosen, row, "chosen").strip()}]
        rejected_turns = [{"role": "assistant", "content": _text(rejected, row, "rejected").strip()}]
    for name, turns in (("chosen", chosen_turns), ("rejected", rejected_turns)):
        if not turns or not any(t["content"].strip() for t in turns if t["role"] == "assistant"):
            raise DataError(f"row {row}: the {name} response is empty: every pair needs two non-empty responses")
    if chosen_turns == rejected_turns:
        raise DataError(f"row {row}: 'chosen' and 'rejected' are identical: a pair must prefer one response "
                        "over a different one (drop the row)")
    return prompt_turns, chosen_turns, rejected_turns


@dataclass
class EncodedPairs:
    prompts: list[list[int]]
    chosen: list[list[int]]
    rejected: list[list[int]]
    skipped_long_prompts: list[int]
    truncated: int


def render_pair(tokenizer, prompt_format: str, prompt: list[dict], chosen: list[dict],
                rejected: list[dict]) -> tuple[str, str, str]:
    """The prompt's text (rendered once) and each response's text as its continuation."""
    if prompt_format == "chat":
        def render(turns: list[dict], generation: bool) -> str:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation)

        head = render(prompt, True)
        responses = []
        for turns in (chosen, rejected):
            full = render(prompt + turns, False)
            if not full.startswith(head):
                raise DataError("the tokenizer's chat template does not render a conversation as a prefix of its "
                                "continuation, so responses cannot be labelled; use --prompt-format tutorial")
            responses.append(full[len(head):])
        return head, responses[0], responses[1]
    if [t["role"] for t in prompt] != ["user"] or len(chosen) != 1 or len(rejected) != 1:
        raise DataError("--prompt-format tutorial takes one user turn and one response per pair; multi-turn or "
                        "system messages need --prompt-format chat")
    eos = tokenizer.eos_token or ""
    return (format_prompt(prompt[0]["content"], ""), " " + chosen[0]["content"] + eos,
            " " + rejected[0]["content"] + eos)


def encode_pairs(rows, tokenizer, max_seq_len: int, prompt_format: str) -> EncodedPairs:
    """Every row checked, rendered and tokenized; a pair whose prompt leaves no room for
    both sequences in one block is skipped (its row listed), one whose responses are too
    long has them cut (the longer first) to fit."""
    prompts = rows["prompt"] if "prompt" in rows.column_names else [None] * len(rows)
    texts = [render_pair(tokenizer, prompt_format, *pair_turns(p, c, r, row))
             for row, (p, c, r) in enumerate(zip(prompts, rows["chosen"], rows["rejected"]))]
    flat = [t for triple in texts for t in triple]
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if prompt_format == "tutorial" and tokenizer.bos_token_id is not None else []
    out = EncodedPairs([], [], [], [], 0)
    for row in range(len(texts)):
        prompt, chosen, rejected = bos + ids[3 * row], ids[3 * row + 1], ids[3 * row + 2]
        budget = max_seq_len - 2 * len(prompt)  # both sequences carry the prompt
        if budget < 2:
            out.skipped_long_prompts.append(row)
            continue
        if len(chosen) + len(rejected) > budget:
            keep_chosen = min(len(chosen), max(budget - len(rejected), budget // 2))
            chosen, rejected = chosen[:keep_chosen], rejected[:budget - keep_chosen]
            out.truncated += 1
        out.prompts.append(prompt)
        out.chosen.append(chosen)
        out.rejected.append(rejected)
    return out


def pair_examples(enc: EncodedPairs, index) -> PairExamples:
    ids, labels, split = [], [], []
    for i in index:
        prompt, chosen, rejected = enc.prompts[i], enc.chosen[i], enc.rejected[i]
        unlabelled = [IGNORE_INDEX] * len(prompt)
        ids.append(prompt + chosen + prompt + rejected)
        labels.append(unlabelled + chosen + unlabelled + rejected)
        split.append(len(prompt) + len(chosen))
    return PairExamples(ids, labels, chosen_lengths=np.asarray(split, dtype=np.int64))


def is_preference(columns) -> bool:
    return all(c in columns for c in COLUMNS)


def prepare_pairs(dataset: str, split: str, tokenizer, max_seq_len: int, eval_fraction: float, seed: int,
                  long_prompts: str = "skip", prompt_format: str = "auto",
                  dataset_format: str = "auto") -> PreparedData:
    """Training and held-out pairs (both `PairExamples`, unpacked), from the same loading
    path as SFT's data (JSONL, JSON, Parquet, CSV, a directory, a Hub id, the bucket)."""
    from .data import with_digest

    rows = load_rows(dataset, split)
    found = detect_format(list(rows.column_names), dataset, dataset_format)
    if found != FORMAT:
        raise DataError(f"--method dpo needs preference data ('chosen' and 'rejected', with a 'prompt' or as "
                        f"conversations sharing one); --dataset {dataset} has the columns {list(rows.column_names)} "
                        f"({found} data): train it with --method full or lora")
    if len(rows) == 0:
        raise DataError(f"--dataset {dataset} split {split!r} has no rows")
    prompt_format = resolve_prompt_format(prompt_format, tokenizer)
    enc = encode_pairs(rows, tokenizer, max_seq_len, prompt_format)
    skipped = enc.skipped_long_prompts
    check_long_prompts(len(skipped), len(rows), skipped[0] if skipped else None, len(enc.prompts), max_seq_len,
                       long_prompts)
    train_idx, eval_idx = split_eval(len(enc.prompts), eval_fraction, seed)
    train = with_digest(pair_examples(enc, train_idx))
    held = pair_examples(enc, eval_idx) if eval_idx else None
    return PreparedData(train=train, eval=held, examples=len(train_idx), eval_examples=len(eval_idx),
                        skipped_long_prompts=len(skipped), truncated=enc.truncated, dataset_format=FORMAT,
                        prompt_format=prompt_format)


@dataclass
class PairPacked(Packed):
    """Packed pairs: `label_tokens` counts the pairs of each block (what DPO's loss and its
    metrics divide by), `reference` ([blocks, segments] fp32) the stored reference
    log-probabilities laid out as the segments (pair_reference)."""

    reference: np.ndarray | None = None


def fill_pair_blocks(pairs: PairExamples, blocks: list[list[int]], max_seq_len: int, pad_id: int,
                     segments: int = 0) -> PairPacked:
    """Blocks of exactly `max_seq_len` tokens, block b holding the pairs `blocks[b]` (in
    index order), each as two segments (chosen 2k - 1, rejected 2k; positions from 0 in
    each), then padding (its own segment, no labels)."""
    # data.fill_blocks lays out the pieces: each pair's chosen and rejected sequences as two
    # examples in a row, so their segments are 2k + 1 and 2k + 2 and positions restart.
    piece_ids, piece_labels, rows = [], [], []
    for members in blocks:
        row = []
        for i in sorted(members):
            tokens, labels, cut = pairs.input_ids[i], pairs.labels[i], int(pairs.chosen_lengths[i])
            row += [len(piece_ids), len(piece_ids) + 1]
            piece_ids += [tokens[:cut], tokens[cut:]]
            piece_labels += [labels[:cut], labels[cut:]]
        rows.append(row)
    packed = fill_blocks(piece_ids, piece_labels, rows, max_seq_len, pad_id)
    counts = np.fromiter(map(len, blocks), dtype=np.int64, count=len(blocks))
    return PairPacked(packed.input_ids, packed.labels, packed.position_ids, packed.segment_ids,
                      packed.real_tokens, counts, reference=pair_reference(pairs, blocks, segments or segment_columns(max_seq_len)))


def segment_columns(max_seq_len: int) -> int:
    """Columns of a block's per-segment sums: two per pair it can hold, and the padding's."""
    return 2 * most_pairs_per_block(max_seq_len) + 2


def pair_reference(pairs: PairExamples, blocks: list[list[int]], segments: int) -> np.ndarray:
    """The stored reference log-probabilities laid out as `fill_pair_blocks` lays out the
    pairs: [blocks, segments] fp32, column 2k the k-th pair's chosen, 2k + 1 its rejected."""
    out = np.zeros((len(blocks), segments), dtype=np.float32)
    if pairs.reference is None:
        return out
    for b, members in enumerate(blocks):
        for k, i in enumerate(sorted(members)):
            out[b, 2 * k:2 * k + 2] = pairs.reference[i]
    return out


def pack_pairs(pairs: PairExamples, max_seq_len: int, pad_id: int) -> tuple[Packed, list[list[int]]]:
    """Every pair packed (best fit, never split): the held-out pairs' blocks, and which
    pairs each holds."""
    from .data import bin_pack

    blocks = bin_pack(pairs.lengths, max_seq_len)
    return fill_pair_blocks(pairs, blocks, max_seq_len, pad_id), blocks


def most_pairs_per_block(max_seq_len: int) -> int:
    """A bound on the pairs one block holds: each takes at least 4 tokens (two sequences of
    a prompt token and a response token)."""
    return max(1, max_seq_len // 4)


