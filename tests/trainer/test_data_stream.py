"""Streamed data preparation (data_stream.py): the examples tokenized a chunk at a time into
files on disk and mapped give exactly what the in-memory path gives (rows, held-out
blocks, plans, packed blocks); a cache entry is taken only when it is complete and of the
same dataset and settings; mapped rows pickle as a description, opened again from the
driver's directory, from a published copy, or from the arrays the pickle carries."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tpufinetune_trainer import data, data_stream, finetune
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.data import BatchPlan
from tpufinetune_trainer.errors import DataError, StorageError

pytestmark = pytest.mark.timeout(120)

MAX_SEQ_LEN = 96


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks that end inside the data, held-out copies a few rows at a time."""
    monkeypatch.setattr(data_stream, "CHUNK_ROWS", 7)
    monkeypatch.setattr(data_stream, "COPY_TOKENS", 300)


def dataset_file(trainer_assets, out: Path, rows: int = 120, edit: str = "") -> Path:
    """The assets' first `rows` dolly rows, in a file of the test's own (its first response
    changed by `edit`)."""
    lines = trainer_assets.data.read_text().splitlines()[:rows]
    if edit:
        row = json.loads(lines[0])
        row["response"] += edit
        lines[0] = json.dumps(row)
    path = out / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def messages_file(out: Path) -> Path:
    """Multi-turn conversations, some with a prompt too long for MAX_SEQ_LEN."""
    rng = np.random.default_rng(3)
    words = ["alpha", "river", "stone", "bright", "seven", "garden", "quiet", "north", "apple", "cloud"]
    rows = []
    for i in range(60):
        turns = []
        for t in range(int(rng.integers(1, 4))):
            say = " ".join(rng.choice(words, int(rng.integers(2, 60 if i % 17 else 200))))
            turns += [{"role": "user", "content": say}, {"role": "assistant", "content": " ".join(rng.choice(words, 9))}]
        rows.append(json.dumps({"messages": turns}))
    path = out / "messages.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def same_packed(a: data.Packed | None, b: data.Packed | None) -> None:
    assert (a is None) == (b is None)
    if a is not None:
        for field in ("input_ids", "labels", "position_ids", "segment_ids", "real_tokens", "label_tokens"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def same_prepared(memory: data.PreparedData, streamed: data.PreparedData) -> None:
    for rows in ("input_ids", "labels"):
        kept, mapped = getattr(memory.train, rows), getattr(streamed.train, rows)
        assert isinstance(mapped, data_stream.MappedRagged)
        assert mapped.values.dtype == kept.values.dtype == np.int32
        np.testing.assert_array_equal(mapped.values, kept.values)
        np.testing.assert_array_equal(mapped.offsets, kept.offsets)
    same_packed(memory.eval, streamed.eval)
    for field in ("examples", "eval_examples", "skipped_long_prompts", "truncated", "dataset_format",
                  "prompt_format"):
        assert getattr(memory, field) == getattr(streamed, field), field


@pytest.mark.parametrize("source,prompt_format,loss_on,eval_fraction", [
    ("dolly", "auto", "responses", 0.1), ("dolly", "tutorial", "all", 0.0), ("messages", "chat", "responses", 0.2)])
def test_streamed_examples_plans_and_blocks_are_the_in_memory_ones(trainer_assets, tokenizer, tmp_path, small_chunks,
                                                                   source, prompt_format, loss_on, eval_fraction):
    path = dataset_file(trainer_assets, tmp_path) if source == "dolly" else messages_file(tmp_path)
    args = (str(path), "train", tokenizer, MAX_SEQ_LEN, eval_fraction, 5, "skip", prompt_format, "auto", loss_on)
    memory = data.prepare(*args, stream=False)
    streamed = data.prepare(*args, cache_dir=tmp_path / "cache")
    same_prepared(memory, streamed)
    if source == "messages":
        assert streamed.skipped_long_prompts and streamed.truncated  # both counted across chunks
    base = BatchPlan(world=2, per_device=3, accum=2)
    kept, mapped = memory.train, streamed.train
    np.testing.assert_array_equal(kept.lengths, mapped.lengths)
    np.testing.assert_array_equal(kept.label_tokens, mapped.label_tokens)
    shape = data.plan_run(kept.lengths, kept.label_tokens, base, 2, 5, MAX_SEQ_LEN)
    assert data.plan_run(mapped.lengths, mapped.label_tokens, base, 2, 5, MAX_SEQ_LEN) == shape
    for epoch in (1, 2):
        plans = [data.plan_epoch(x.lengths, x.label_tokens, shape.plan, epoch, 5, MAX_SEQ_LEN) for x in (kept, mapped)]
        assert plans[0].blocks == plans[1].blocks
        np.testing.assert_array_equal(plans[0].slots, plans[1].slots)
        for rank in range(base.world):
            full = data.rank_blocks(kept, plans[0], rank, MAX_SEQ_LEN, 0)
            same_packed(full, data.rank_blocks(mapped, plans[1], rank, MAX_SEQ_LEN, 0))
            # A window of steps packs what the whole epoch's blocks hold for those steps.
            per = shape.plan.accum * shape.plan.blocks
            window = data.rank_blocks(mapped, plans[1], rank, MAX_SEQ_LEN, 0, steps=slice(1, 3))
            np.testing.assert_array_equal(window.input_ids, full.input_ids[per:3 * per])
            np.testing.assert_array_equal(window.labels, full.labels[per:3 * per])


def test_digest_read_in_parts_is_the_whole_arrays(trainer_assets, tokenizer, tmp_path):
    """resume.examples_digest hashes the tokens as int64; read a part at a time (what a
    mapped dataset needs: the int64 copy of every token is twice the files) the digest is
    the same."""
    import hashlib

    from tpufinetune_trainer import resume

    prepared = data.prepare(str(dataset_file(trainer_assets, tmp_path)), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5,
                            cache_dir=tmp_path / "cache")
    examples = prepared.train
    digest = hashlib.blake2b(digest_size=8)
    digest.update(examples.lengths.tobytes())
    for rows in (examples.input_ids, examples.labels):
        for part in rows.parts(tokens=1000):
            digest.update(part.astype(np.int64).tobytes())
    assert resume.examples_digest(examples) == f"{len(examples)} examples, digest {digest.hexdigest()}"


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir())


def test_an_entry_is_reused_only_for_the_same_dataset_and_settings(trainer_assets, tokenizer, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    first_dir.mkdir()
    second_dir.mkdir()
    path = dataset_file(trainer_assets, first_dir)
    args = [str(path), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5]
    made = data.prepare(*args, cache_dir=cache)
    [entry] = entries(cache)

    def no_build(*_a, **_k):
        raise AssertionError("a complete entry of the same dataset and settings is built again")

    with monkeypatch.context() as m:
        m.setattr(data_stream, "build", no_build)
        again = data.prepare(*args, cache_dir=cache)
    same_prepared(data.prepare(*args, stream=False), again)
    assert again.train.input_ids.part == made.train.input_ids.part
    # Another dataset (one response longer, same row count), split, length, seed, held-out
    # fraction, prompt format, label setting or tokenizer: another entry, never the first.
    edited = dataset_file(trainer_assets, second_dir, edit=" and more")
    changes = [dict(dataset=str(edited)), dict(split="train[:100]"), dict(max_seq_len=MAX_SEQ_LEN + 1),
               dict(seed=6), dict(eval_fraction=0.2), dict(prompt_format="tutorial"), dict(loss_on="all")]
    seen = {entry.name}
    for change in changes:
        call = dict(dataset=str(path), split="train", tokenizer=tokenizer, max_seq_len=MAX_SEQ_LEN,
                    eval_fraction=0.1, seed=5)
        call.update(change)
        streamed = data.prepare(**call, cache_dir=cache)
        same_prepared(data.prepare(**call, stream=False), streamed)
        name = Path(streamed.train.input_ids.part.directory).name
        assert name not in seen, change
        seen.add(name)
    other = type(tokenizer).from_pretrained(str(trainer_assets.model))
    other.add_tokens(["zebraword"])
    assert data_stream.tokenizer_digest(other) != data_stream.tokenizer_digest(tokenizer)
    # The same file rewritten in place with other content (its size or time changes).
    path.write_text(edited.read_text())
    streamed = data.prepare(*args, cache_dir=cache)
    assert Path(streamed.train.input_ids.part.directory).name not in seen
    same_prepared(data.prepare(*args, stream=False), streamed)


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from tpufinetune_trainer import data, data_stream
    from tpufinetune_trainer.model import load_tokenizer

    model, dataset, cache, when = sys.argv[1:5]
    data_stream.CHUNK_ROWS = 10
    real_append, real_split = data_stream.RaggedWriter.append, data_stream.split_files
    calls = []

    def append(self, *args):
        real_append(self, *args)
        calls.append(1)
        if when == "tokenizing" and len(calls) == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    def split_files(directory, *args):
        out = real_split(directory, *args)
        if when == "marker":  # every file written, the marker not yet
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    data_stream.RaggedWriter.append, data_stream.split_files = append, split_files
    data.prepare(dataset, "train", load_tokenizer(model), 96, 0.1, 5, cache_dir=cache)
""")


@pytest.mark.parametrize("when", ["tokenizing", "marker"])
def test_a_half_written_entry_is_never_taken(trainer_assets, tokenizer, tmp_path, when):
    cache = tmp_path / "cache"
    path = dataset_file(trainer_assets, tmp_path)
    run = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(trainer_assets.model), str(path), str(cache), when],
                         capture_output=True, text=True, timeout=100)
    assert run.returncode == -9, run.stderr
    left = entries(cache)
    assert left and all(".partial-" in p.name for p in left)  # only the killed writer's own directory
    assert not any(data_stream.read_meta(p) for p in left)
    # Its files moved to the entry's name by hand, still without the marker: not taken either.
    fp = left[0].name.split(".partial-")[0]
    shutil.copytree(left[0], cache / fp)
    streamed = data.prepare(str(path), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5, cache_dir=cache)
    assert Path(streamed.train.input_ids.part.directory).name == fp
    same_prepared(data.prepare(str(path), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5, stream=False), streamed)
    assert [p.name for p in entries(cache)] == [fp]  # the dead writer's directory is gone


def test_a_marker_whose_files_are_short_is_not_taken(trainer_assets, tokenizer, tmp_path):
    cache = tmp_path / "cache"
    path = dataset_file(trainer_assets, tmp_path)
    made = data.prepare(str(path), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5, cache_dir=cache)
    entry = Path(made.train.input_ids.part.directory)
    del made
    tokens = entry / "train.tokens"
    tokens.write_bytes(tokens.read_bytes()[:-4])
    assert data_stream.read_meta(entry) is None
    meta = json.loads((entry / data_stream.META).read_text())
    assert data_stream.read_meta(entry, "another") is None
    again = data.prepare(str(path), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5, cache_dir=cache)
    assert data_stream.read_meta(entry, meta["fingerprint"])  # built again, whole
    same_prepared(data.prepare(str(path), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5, stream=False), again)


def test_mapped_rows_pickle_as_a_description(trainer_assets, tokenizer, tmp_path, monkeypatch):
    """On the driver's host the files are mapped again; on a host without them, the
    published copy (fetched once per host into its storage cache) or, before anything is
    published, the arrays the pickle carries."""
    cache = tmp_path / "cache"
    path = dataset_file(trainer_assets, tmp_path)
    train = data.prepare(str(path), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5, cache_dir=cache).train
    want = (train.input_ids.values.copy(), train.input_ids.offsets.copy(), train.labels.values.copy())

    def check(examples, mapped: bool):
        assert isinstance(examples.input_ids, data_stream.MappedRagged) == mapped
        for got, expected in zip((examples.input_ids.values, examples.input_ids.offsets, examples.labels.values), want):
            np.testing.assert_array_equal(got, expected)

    check(pickle.loads(pickle.dumps(train, protocol=5)), mapped=True)
    unpublished = pickle.dumps(train, protocol=5)
    published = data_stream.publish(train, f"file://{tmp_path / 'storage'}", "run-1")
    slim = pickle.dumps(published, protocol=5)
    assert len(slim) < 2000 < len(unpublished)  # the description alone, without the arrays
    assert (tmp_path / "storage" / "run-1" / "data" / train.input_ids.part.fingerprint / data_stream.META).exists()
    del train, published
    # Another host: the driver's directory is not there.
    shutil.rmtree(cache)
    check(pickle.loads(unpublished), mapped=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "host-cache"))
    check(pickle.loads(slim), mapped=True)
    assert any((tmp_path / "host-cache" / "tpufinetune" / "storage").iterdir())  # fetched into this host's cache
    shutil.rmtree(tmp_path / "storage")
    shutil.rmtree(tmp_path / "host-cache")
    with pytest.raises(DataError, match="publish"):
        pickle.loads(slim)


def test_long_prompts_fail_stops_reading_at_the_first_chunk_that_has_one(tokenizer, tmp_path, small_chunks,
                                                                         monkeypatch):
    """--long-prompts fail refuses the data without tokenizing the rest of the dataset: the
    reading stops with the chunk holding the first prompt too long, and nothing is cached."""
    path = messages_file(tmp_path)
    with pytest.raises(DataError) as whole:
        data.prepare(str(path), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5, long_prompts="fail", stream=False)
    first = int(str(whole.value).split("(first: row ")[1].split(")")[0])
    chunks = []
    encode = data.encode_rows
    monkeypatch.setattr(data, "encode_rows", lambda rows, *a, **k: chunks.append(len(rows)) or encode(rows, *a, **k))
    with pytest.raises(DataError, match=rf"of the first {(first // 7 + 1) * 7} examples .*\(first: row {first}\)"):
        data.prepare(str(path), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5, long_prompts="fail",
                     cache_dir=tmp_path / "cache")
    assert chunks == [7] * (first // 7 + 1) and sum(chunks) < 60, chunks
    assert not list((tmp_path / "cache").rglob(data_stream.META))
    chunks.clear()
    skipped = data.prepare(str(path), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5, cache_dir=tmp_path / "cache")
    assert sum(chunks) == 60 and skipped.skipped_long_prompts > 1  # skip reads every row


def test_the_driver_publishes_mapped_examples_to_the_runs_storage(trainer_assets, tokenizer, tmp_path):
    """finetune's choice: mapped examples are published to the run's storage (for later
    attempts, and for workers on other hosts) on one node or many, and ship as their
    description; examples in memory ship as they are; a storage that refuses the upload
    fails naming the flag."""
    path = dataset_file(trainer_assets, tmp_path)
    train = data.prepare(str(path), "train", tokenizer, MAX_SEQ_LEN, 0.1, 5, cache_dir=tmp_path / "cache").train
    cfg = FinetuneConfig(model_id="m", storage_path=f"file://{tmp_path / 'storage'}", run_name="run-1")
    assert finetune.shipped_examples(train, cfg, alive_nodes=1).input_ids.part.mirror
    assert (tmp_path / "storage" / "run-1" / "data" / train.input_ids.part.fingerprint / data_stream.META).exists()
    shipped = finetune.shipped_examples(train, cfg, alive_nodes=5)
    assert shipped.input_ids.part.mirror.endswith(f"/run-1/data/{train.input_ids.part.fingerprint}")
    assert len(pickle.dumps(shipped, protocol=5)) < 2000 < len(pickle.dumps(train, protocol=5))
    in_memory = data.Examples(data.Ragged(train.input_ids.values.copy(), train.input_ids.offsets.copy()),
                              data.Ragged(train.labels.values.copy(), train.labels.offsets.copy()))
    assert finetune.shipped_examples(in_memory, cfg, alive_nodes=5) is in_memory
    (tmp_path / "file").write_text("not a directory")
    refused = FinetuneConfig(model_id="m", storage_path=f"file://{tmp_path / 'file'}", run_name="run-1")
    with pytest.raises(StorageError, match="--storage-path"):
        finetune.shipped_examples(train, refused, alive_nodes=2)


@pytest.mark.parametrize("n,fraction,seed", [(1, 0.0, 0), (10, 0.1, 3), (977, 0.05, 42), (5000, 0.3, 7)])
def test_held_out_rows_are_split_evals(n, fraction, seed):
    """The split that runs made when it shuffled a list of Python ints (a resume finds the
    same held-out rows), now from an int64 array."""
    order = list(range(n))
    held = max(1, int(round(n * fraction))) if fraction > 0 else 0
    if held:
        random.Random(seed).shuffle(order)
    assert data.held_out(n, fraction, seed).tolist() == sorted(order[:held])
    assert data.split_eval(n, fraction, seed) == (sorted(order[held:]), sorted(order[:held]))
    with pytest.raises(DataError):
        data.held_out(4, 0.9, 0)


def test_prune_removes_only_old_entries_and_dead_writers(tmp_path):
    import fcntl

    root = tmp_path / "cache"
    old, recent, foreign = root / ("a" * 32), root / ("b" * 32), root / "notes"
    dead, busy = root / f"{'c' * 32}.partial-0000abcd", root / f"{'d' * 32}.partial-1111abcd"
    for directory in (old, recent, foreign, dead, busy):
        directory.mkdir(parents=True)
    for entry in (old, recent):
        (entry / data_stream.META).write_text("{}")
    week_ago = data_stream.time.time() - data_stream.KEEP_UNUSED_S - 60
    os.utime(old / data_stream.META, (week_ago, week_ago))
    os.utime(foreign, (week_ago, week_ago))
    with open(root / f"{'d' * 32}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a live writer's
        data_stream.prune(root, keep="e" * 32)
    assert sorted(p.name for p in entries(root)) == sorted(p.name for p in (recent, foreign, busy))
