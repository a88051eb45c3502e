"""The training examples' digest (the resume fingerprint's `train_examples`) is hashed once,
where the data is prepared: a streamed cache entry keeps it in its meta.json (a later
prepare of the same data hashes nothing), in-memory data gets it at prepare, and it travels
with the examples (pickled as Ray ships them, or published for other hosts), so a worker's
start reads no token for it: every worker used to re-hash the whole dataset as int64."""

from __future__ import annotations

import pickle

from tpufinetune_trainer import data, finetune, resume
from tpufinetune_trainer.config import FinetuneConfig

LENGTH = 256


def prepare(assets, tmp_path, **options):
    return data.prepare(str(assets.data), "train[:160]", options.pop("tokenizer"), LENGTH, 0.1, 42, **options)


def test_the_digest_is_hashed_once_where_the_data_is_prepared_and_carried_to_the_workers(
        trainer_assets, tokenizer, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    train = prepare(trainer_assets, tmp_path, tokenizer=tokenizer, cache_dir=cache).train
    expected = data.hash_examples(data.Examples(train.input_ids, train.labels))  # read from the tokens
    assert train.digest == expected

    reads = []
    original = data.Ragged.parts

    def counted(self, tokens=1 << 22):
        reads.append(len(self.values))
        return original(self, tokens)

    monkeypatch.setattr(data.Ragged, "parts", counted)
    cfg = FinetuneConfig(model_id="m", storage_path=str(tmp_path / "storage"), run_name="run-1", num_workers=2,
                         max_seq_len=LENGTH, batch_size_per_device=2).validate()
    shipped = pickle.loads(pickle.dumps(train, protocol=5))  # as Ray's object store hands it to a worker
    published = finetune.shipped_examples(train, cfg, alive_nodes=3)  # for workers on other hosts
    for worker_copy in (shipped, pickle.loads(pickle.dumps(published, protocol=5))):
        assert resume.fingerprint(cfg, 2, worker_copy)["train_examples"] == expected
    again = prepare(trainer_assets, tmp_path, tokenizer=tokenizer, cache_dir=cache).train  # the cache entry
    assert again.digest == expected
    assert reads == [], "a worker's start or a cache hit read the tokens to hash them"

    monkeypatch.undo()
    in_memory = prepare(trainer_assets, tmp_path, tokenizer=tokenizer, stream=False).train
    assert in_memory.digest == expected
