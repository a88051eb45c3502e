"""Preference data (preference.py): the formats users have, recognised from the columns,
rendered with the prompt once and labels on response tokens only, packed as two segments
per pair never split across blocks; every malformed row refused naming its row."""

from __future__ import annotations

import numpy as np
import pytest

from tpufinetune_trainer.data import IGNORE_INDEX, bin_pack, prepare
from tpufinetune_trainer.errors import DataError
from tpufinetune_trainer.preference import PairExamples, fill_pair_blocks, prepare_pairs
from trainer_helpers import write_jsonl

STANDARD = [{"prompt": f"What is {a} plus {b}?", "chosen": f"It is {a + b}.", "rejected": f"It is {a + b + 1}."}
            for a in range(6) for b in range(4)]


def conversational(n: int) -> list[dict]:
    rows = []
    for k in range(n):
        shared = [{"role": "user", "content": f"Name the number after {k}."}]
        rows.append({"chosen": shared + [{"role": "assistant", "content": f"{k + 1}."}],
                     "rejected": shared + [{"role": "assistant", "content": f"Maybe {k + 7}, or {k}."}]})
    return rows


def prepared(tokenizer, path, **kw) -> object:
    args = dict(eval_fraction=0.0, seed=1, long_prompts="fail")
    args.update(kw)
    return prepare_pairs(str(path), "train", tokenizer, 256, args.pop("eval_fraction"), args.pop("seed"), **args)


def sequences(pairs: PairExamples, i: int):
    ids, labels, cut = pairs.input_ids[i], pairs.labels[i], int(pairs.chosen_lengths[i])
    return (ids[:cut], labels[:cut]), (ids[cut:], labels[cut:])


def response_of(ids, labels) -> list[int]:
    return [int(t) for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]


@pytest.mark.parametrize("prompt_format", ["chat", "tutorial"])
def test_standard_pairs_share_one_prompt_and_label_only_responses(tokenizer, tmp_path, prompt_format):
    data = prepared(tokenizer, write_jsonl(tmp_path / "p.jsonl", STANDARD), prompt_format=prompt_format)
    assert data.dataset_format == "preference" and data.examples == len(STANDARD)
    pairs = data.train
    for i, row in enumerate(STANDARD):
        (c_ids, c_lab), (r_ids, r_lab) = sequences(pairs, i)
        prompt_len = next(k for k, lab in enumerate(c_lab) if lab != IGNORE_INDEX)
        assert list(c_ids[:prompt_len]) == list(r_ids[:prompt_len])  # the same prompt tokens in both
        assert all(lab == IGNORE_INDEX for lab in r_lab[:prompt_len])
        assert list(c_lab[prompt_len:]) == list(c_ids[prompt_len:])  # every response token, only them
        chosen_text = tokenizer.decode(response_of(c_ids, c_lab))
        rejected_text = tokenizer.decode(response_of(r_ids, r_lab))
        assert row["chosen"] in chosen_text and row["rejected"] in rejected_text, (chosen_text, rejected_text)
        assert row["prompt"] in tokenizer.decode(list(c_ids[:prompt_len]))


def test_parquet_and_conversational_pairs_are_recognised(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(STANDARD), path)
    assert prepared(tokenizer, path).examples == len(STANDARD)
    rows = conversational(10)
    data = prepared(tokenizer, write_jsonl(tmp_path / "c.jsonl", rows))
    for i, row in enumerate(rows):
        (c_ids, c_lab), (r_ids, r_lab) = sequences(data.train, i)
        assert tokenizer.decode(response_of(c_ids, c_lab)).startswith(row["chosen"][-1]["content"])
        assert tokenizer.decode(response_of(r_ids, r_lab)).startswith(row["rejected"][-1]["content"])
        prompt = tokenizer.decode([int(t) for t, lab in zip(c_ids, c_lab) if lab == IGNORE_INDEX])
        assert row["chosen"][0]["content"] in prompt and "assistant" not in prompt.split("model")[-1]


def test_pairs_pack_as_two_segments_never_split(tokenizer, tmp_path):
    data = prepared(tokenizer, write_jsonl(tmp_path / "p.jsonl", STANDARD), eval_fraction=0.25)
    assert data.eval_examples == 6 and data.examples == len(STANDARD) - 6
    pairs = data.train
    blocks = bin_pack(pairs.lengths, 64)
    packed = fill_pair_blocks(pairs, blocks, 64, 0)
    assert sorted(i for b in blocks for i in b) == list(range(len(pairs)))  # every pair once, whole
    for b, members in enumerate(blocks):
        seg, pos, ids = packed.segment_ids[b], packed.position_ids[b], packed.input_ids[b]
        for k, i in enumerate(sorted(members)):
            (c_ids, _), (r_ids, _) = sequences(pairs, i)
            for s, want in ((2 * k + 1, c_ids), (2 * k + 2, r_ids)):
                assert list(ids[seg == s]) == list(want) and list(pos[seg == s]) == list(range(len(want)))
        assert set(seg[packed.real_tokens[b]:]) <= {2 * len(members) + 1}  # padding: its own segment


def bad(tmp_path, rows) -> str:
    return str(write_jsonl(tmp_path / "bad.jsonl", STANDARD[:3] + rows))


@pytest.mark.parametrize("row, words", [
    ({"prompt": "Hi?", "chosen": None, "rejected": "No."}, "row 3: the preference pair has no 'chosen'"),
    ({"prompt": "Hi?", "chosen": "Yes.", "rejected": None}, "row 3: the preference pair has no 'rejected'"),
    ({"prompt": None, "chosen": "Yes.", "rejected": "No."}, "row 3: the preference pair has no 'prompt'"),
    ({"prompt": "Hi?", "chosen": "  ", "rejected": "No."}, "row 3: the chosen response is empty"),
    ({"prompt": "Hi?", "chosen": "Yes.", "rejected": ""}, "row 3: the rejected response is empty"),
    ({"prompt": "Hi?", "chosen": "Same.", "rejected": "Same."}, "row 3: 'chosen' and 'rejected' are identical"),
])
def test_malformed_rows_are_refused_by_number(tokenizer, tmp_path, row, words):
    with pytest.raises(DataError) as refused:
        prepared(tokenizer, bad(tmp_path, [row]))
    assert words in str(refused.value), str(refused.value)


def test_malformed_conversations_are_refused_by_number(tokenizer, tmp_path):
    rows = conversational(3) + [{"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                 "rejected": [{"role": "user", "content": "c"},
                                              {"role": "assistant", "content": "d"}]}]
    with pytest.raises(DataError, match="row 3: 'chosen' and 'rejected' share no prompt turns"):
        prepared(tokenizer, write_jsonl(tmp_path / "c.jsonl", rows))
    same = conversational(4)
    same[2]["rejected"] = same[2]["chosen"]
    with pytest.raises(DataError, match="row 2: 'chosen' and 'rejected' are identical"):
        prepared(tokenizer, write_jsonl(tmp_path / "d.jsonl", same))


def test_long_prompts_fail_by_row_or_are_skipped_and_counted(tokenizer, tmp_path):
    long = {"prompt": "word " * 300, "chosen": "Yes.", "rejected": "No."}
    path = bad(tmp_path, [long])
    with pytest.raises(DataError, match=r"1 of 4 examples have a prompt longer than --max-seq-len=256 tokens "
                                        r"\(first: row 3\)"):
        prepared(tokenizer, path, long_prompts="fail")
    data = prepared(tokenizer, path, long_prompts="skip")
    assert data.skipped_long_prompts == 1 and data.examples == 3


def test_supervised_and_preference_data_do_not_mix(tokenizer, tmp_path, trainer_assets):
    with pytest.raises(DataError, match="is preference data .* train it with --method dpo"):
        prepare(str(write_jsonl(tmp_path / "p.jsonl", STANDARD)), "train", tokenizer, 256, 0.0, 1)
    with pytest.raises(DataError, match="--method dpo needs preference data"):
        prepare_pairs(str(trainer_assets.data), "train[:10]", tokenizer, 256, 0.0, 1)
