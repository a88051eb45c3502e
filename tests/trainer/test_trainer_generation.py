"""Each epoch's generation metrics (generation.py, --generate-*): the trainer's loop
(Trainer.run, a one-rank gloo group, FSDP2 on the tiny Gemma) answers held-out prompts of a
memorisation task after every epoch's held-out loss; exact match and ROUGE-L rise over three
epochs, the figures are rouge-score's and sacrebleu's on the samples it saved beside the
checkpoints, they reach the epoch event, the epoch line and TensorBoard, and --keep-best-by
ranks the checkpoints by the named metric. Only ray.train.report (no Ray Train session in a
plain process) and the export (its own tests) are left out."""

from __future__ import annotations

import json

import pytest

from tpufinetune_trainer import finish, generation, run_events
from trainer_helpers import make_trainer, write_jsonl

NAMES = ["Aron", "Belo", "Cira", "Doma", "Efra", "Gilo"]
ANSWERS = ["red apples and green pears", "blue fish in the sea", "green grass on the hill",
           "white snow in the north", "black cats at the night", "yellow lemons from the south"]
EPOCHS = 3


@pytest.fixture(scope="module")
def memorised(trainer_assets, process_group, tmp_path_factory):
    """Three epochs on six questions, each repeated 20 times (the held-out tenth are copies of
    training rows: a task the tiny model learns in seconds), 12 answers an epoch, the best
    checkpoint kept by ROUGE-L. Returns (trainer, events, storage, printed lines)."""
    import ray.train

    from tpufinetune_trainer.data import pad_id_of, prepare
    from tpufinetune_trainer.model import load_tokenizer

    tmp = tmp_path_factory.mktemp("generation")
    rows = [{"instruction": f"What colour does {name} like?", "context": "", "response": answer}
            for name, answer in zip(NAMES, ANSWERS)] * 20
    write_jsonl(tmp / "memo.jsonl", rows)
    tokenizer = load_tokenizer(str(trainer_assets.model))
    prepared = prepare(str(tmp / "memo.jsonl"), "train", tokenizer, 128, 0.1, 42)
    data = {"train": prepared.train, "eval": prepared.eval, "pad_id": pad_id_of(tokenizer)}
    events, lines = [], []
    patch = pytest.MonkeyPatch()
    patch.setattr(ray.train, "report", lambda *args, **kwargs: None)
    patch.setattr(run_events, "emit", lambda kind, **fields: events.append((kind, fields)))
    patch.setattr(run_events, "say", lines.append)
    try:
        trainer = make_trainer(trainer_assets.model, data, tmp / "storage", run_name="gen", num_epochs=EPOCHS,
                               batch_size_per_device=8, max_seq_len=128, generate_examples=12,
                               generate_max_new_tokens=16, keep_best_by="rougeL")
        trainer.export = lambda: trainer.settle_checkpoint(wait=True)  # the last checkpoint, no export
        trainer.run()
    finally:
        patch.undo()
    return trainer, [fields for kind, fields in events if kind == "epoch"], tmp / "storage", lines


def test_exact_match_and_rouge_l_rise_across_the_epochs(memorised):
    _, epochs, _, _ = memorised
    exact = [e["eval_exact_match"] for e in epochs]
    rouge = [e["eval_rouge_l"] for e in epochs]
    assert len(epochs) == EPOCHS and all(e["eval_generated"] == 12 for e in epochs)
    assert exact[0] < exact[-1] and rouge[0] < rouge[-1], (exact, rouge)
    assert exact[-1] >= 0.5 and rouge[-1] >= 0.8, (exact, rouge)
    assert all(e["eval_bleu"] is not None for e in epochs)


def test_the_figures_are_the_libraries_on_the_saved_samples(memorised):
    from rouge_score import rouge_scorer
    import sacrebleu

    _, epochs, storage, _ = memorised
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    for event in epochs:
        uri = event["eval_samples_uri"]
        assert uri == str(storage / "gen" / "eval-samples" / f"epoch-{event['epoch']}.jsonl")
        samples = [json.loads(line) for line in open(uri, encoding="utf-8")]
        assert len(samples) == 12 and all(s["prompt"].endswith("model\n") for s in samples)
        outputs, references = [s["output"] for s in samples], [s["reference"] for s in samples]
        assert set(references) <= set(ANSWERS)
        exact = sum(o.strip() == r.strip() for o, r in zip(outputs, references)) / len(samples)
        rouge = sum(scorer.score(r, o)["rougeL"].fmeasure for o, r in zip(outputs, references)) / len(samples)
        bleu = sacrebleu.corpus_bleu(outputs, [references]).score
        assert (event["eval_exact_match"], event["eval_rouge_l"], event["eval_bleu"]) == (
            round(exact, 4), round(rouge, 4), round(bleu, 4)), event


def test_the_epoch_line_and_tensorboard_show_them(memorised):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, epochs, storage, lines = memorised
    shown = [line for line in lines if line.startswith("Epoch ")]
    assert len(shown) == EPOCHS and all(f"rouge_l={e['eval_rouge_l']:.4f}" in line and "(12 answers)" in line
                                        for e, line in zip(epochs, shown)), shown
    (folder,) = (storage / "gen" / "tensorboard").iterdir()
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    for tag, key in (("eval/exact_match", "eval_exact_match"), ("eval/rouge_l", "eval_rouge_l"),
                     ("eval/bleu", "eval_bleu")):
        series = accumulator.Scalars(tag)
        assert [s.step for s in series] == [e["step"] for e in epochs], tag
        assert [s.value for s in series] == pytest.approx([e[key] for e in epochs], rel=1e-6), tag
    texts = accumulator.Tensors("eval/samples/text_summary")
    assert [t.step for t in texts] == [e["step"] for e in epochs]
    last = texts[-1].tensor_proto.string_val[0].decode()
    assert "| prompt | reference | answer |" in last and "snow in the north" in last


def test_keep_best_by_ranks_the_checkpoints_by_the_metric(memorised):
    trainer, epochs, _, _ = memorised
    cfg = trainer.cfg
    assert (cfg.checkpoint_score_attribute, cfg.checkpoint_score_order) == ("eval_rouge_l", "max")
    best = finish.best_entry(trainer.history, cfg.checkpoint_score_attribute, cfg.checkpoint_score_order)
    highest = max(epochs, key=lambda e: e["eval_rouge_l"])  # the earliest on a tie, as Ray
    assert best["epoch"] == highest["epoch"] and best["eval_rouge_l"] == highest["eval_rouge_l"]
    assert best["epoch"] != min(epochs, key=lambda e: e["eval_rouge_l"])["epoch"]


def test_score_is_the_libraries_on_small_cases():
    outputs = ["the cat sat on the mat", " blue fish ", "a cat sat here"]
    references = ["the cat sat on the mat", "blue fish", "a cat on a mat today"]
    found = generation.score(outputs, references, list(generation.GENERATION_METRICS))
    assert found["exactMatch"] == pytest.approx(2 / 3)
    from rouge_score import rouge_scorer
    import sacrebleu

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    assert found["rougeL"] == pytest.approx(
        sum(scorer.score(r, o)["rougeL"].fmeasure for o, r in zip(outputs, references)) / 3)
    assert found["bleu"] == pytest.approx(sacrebleu.corpus_bleu(outputs, [references]).score)
    assert generation.score(outputs, references, ["bleu"]).keys() == {"bleu"}


def test_shares_pad_to_one_count_so_every_rank_runs_as_many_forwards():
    shares = [generation.rank_share(7, rank, 3) for rank in range(3)]
    assert [indices for indices, _ in shares] == [[0, 3, 6], [1, 4], [2, 5]]
    assert {count for _, count in shares} == {3}
    assert sorted(i for indices, _ in shares for i in indices) == list(range(7))
