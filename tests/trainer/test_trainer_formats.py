"""Dataset formats, the chat template's labels, the schedule, and the operator's fold of
progress events (pure, fast)."""

from __future__ import annotations

import numpy as np
import pytest
from datasets import Dataset

from tpufinetune.core.runevents import apply_event, split_malformed
from tpufinetune_trainer.cli import build_parser
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.data import IGNORE_INDEX, detect_format, encode_rows, pack, prepare, resolve_prompt_format
from tpufinetune_trainer.errors import ConfigError, DataError
from tpufinetune_trainer.schedule import decay_steps, lr_table, warmup_steps

from trainer_helpers import write_jsonl


def labelled_text(tokenizer, ids, labels) -> str:
    return tokenizer.decode([t for t, l in zip(ids, labels) if l != IGNORE_INDEX])


def test_chat_is_the_default_for_a_tokenizer_with_a_template(tokenizer):
    assert resolve_prompt_format("auto", tokenizer) == "chat"
    assert resolve_prompt_format("tutorial", tokenizer) == "tutorial"


def test_chat_format_labels_only_the_assistant_turn(tokenizer):
    rows = Dataset.from_list([{"instruction": "Name a fruit.", "context": "Be brief.", "response": " Apple. "}])
    enc = encode_rows(rows, tokenizer, 512, "chat")
    ids, labels = enc.input_ids[0], enc.labels[0]
    text = tokenizer.decode(ids)
    assert text == ("<bos><start_of_turn>user\nName a fruit.\n\nBe brief.<end_of_turn>\n"
                    "<start_of_turn>model\nApple.<end_of_turn>\n")
    assert labelled_text(tokenizer, ids, labels) == "Apple.<end_of_turn>\n"  # answer and its end marker


@pytest.mark.parametrize("prompt_format", ["chat", "tutorial"])
def test_loss_on_all_labels_every_token_but_the_first_and_no_label_crosses_a_packed_boundary(tokenizer,
                                                                                              prompt_format):
    rows = Dataset.from_list([{"instruction": "Name a fruit.", "context": "Be brief.", "response": "Apple."},
                              {"instruction": "Name a colour.", "context": "", "response": "Red."}])
    responses = encode_rows(rows, tokenizer, 512, prompt_format)
    everything = encode_rows(rows, tokenizer, 512, prompt_format, loss_on="all")
    assert everything.input_ids == responses.input_ids  # the same tokens; only the labels differ
    for ids, labels in zip(everything.input_ids, everything.labels):
        assert labels == [IGNORE_INDEX] + ids[1:]  # the tutorial's labels: every token, prompt included
    packed = pack(everything.input_ids, everything.labels, 64, 0)
    assert len(packed) == 1
    starts = np.flatnonzero(np.diff(packed.segment_ids[0])) + 1  # where the next example (or padding) starts
    assert len(starts) >= 1 and all(packed.labels[0, k] == IGNORE_INDEX for k in starts)  # nobody's target
    with pytest.raises(DataError, match="--loss-on 'prompts'"):
        encode_rows(rows, tokenizer, 512, prompt_format, loss_on="prompts")


def test_multi_turn_messages_label_every_assistant_turn_and_nothing_else(tokenizer):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Count to two."}, {"role": "assistant", "content": "One, two."}]
    enc = encode_rows(Dataset.from_list([{"messages": turns}]), tokenizer, 512, "chat")
    assert labelled_text(tokenizer, enc.input_ids[0], enc.labels[0]) == (
        "Hello.<end_of_turn>\nOne, two.<end_of_turn>\n")
    with pytest.raises(DataError, match="multi-turn or system messages need --prompt-format chat"):
        encode_rows(Dataset.from_list([{"messages": turns}]), tokenizer, 512, "tutorial")


def test_prompt_completion_rows(tokenizer):
    rows = Dataset.from_list([{"prompt": "2+2=", "completion": "4"}])
    chat = encode_rows(rows, tokenizer, 512, "chat")
    assert labelled_text(tokenizer, chat.input_ids[0], chat.labels[0]) == "4<end_of_turn>\n"
    tutorial = encode_rows(rows, tokenizer, 512, "tutorial")
    assert tokenizer.decode(tutorial.input_ids[0]) == "<bos>Instruction: 2+2=\nResponse: 4<eos>"


def test_formats_are_detected_from_columns_and_errors_name_the_fix():
    assert detect_format(["instruction", "context", "response", "category"], "d") == "dolly"
    assert detect_format(["messages"], "d") == "messages"
    assert detect_format(["prompt", "completion"], "d") == "prompt-completion"
    with pytest.raises(DataError, match=r"missing column\(s\) \['completion'\] for --dataset-format prompt-completion"):
        detect_format(["prompt", "answer"], "d", "prompt-completion")
    with pytest.raises(DataError, match="name it with --dataset-format"):
        detect_format(["question", "answer"], "d")


def test_a_long_chat_prompt_is_skipped_and_a_long_answer_truncated(tmp_path, tokenizer):
    rows = [{"instruction": "Say yes.", "context": "", "response": "Yes."}] * 20
    rows += [{"instruction": "word " * 300, "context": "", "response": "x"}]
    rows += [{"instruction": "Go on.", "context": "", "response": "more " * 300}]
    data = prepare(str(write_jsonl(tmp_path / "rows.jsonl", rows)), "train", tokenizer, 128, 0.0, 0)
    assert data.prompt_format == "chat" and data.skipped_long_prompts == 1 and data.truncated == 1
    assert data.train.label_tokens.sum() == sum(sum(t != IGNORE_INDEX for t in y[1:]) for y in data.train.labels)
    assert max(data.train.lengths) == 128


def test_warmup_then_cosine_decay_to_the_floor():
    table = lr_table(1e-3, 100, warmup_steps(100, 0.1), "cosine", 0.1)
    assert len(table) == 100 and warmup_steps(100, 0.1) == 10
    assert np.all(np.diff(table[:10]) > 0) and table[9] == pytest.approx(1e-3)
    assert np.all(np.diff(table[10:]) <= 1e-12) and table[-1] == pytest.approx(1e-4)
    linear = lr_table(1e-3, 100, 0, "linear", 0.0)
    assert linear[0] < 1e-3 and linear[-1] == pytest.approx(0.0)
    assert np.all(lr_table(1e-3, 10, 0, "constant", 0.1) == np.float32(1e-3))


def test_warmup_then_the_peak_held_then_a_decay_over_the_last_steps():
    warmup, decay = warmup_steps(100, 0.05), decay_steps(100, 5, 0.2)
    assert (warmup, decay) == (5, 20)
    table = lr_table(1e-3, 100, warmup, "cosine", 0.1, decay)
    assert np.all(np.diff(table[:5]) > 0) and np.all(table[4:80] == np.float32(1e-3))
    assert np.all(np.diff(table[80:]) < 0) and table[-1] == pytest.approx(1e-4)
    # A decay over every step after the warmup is the classic schedule.
    assert np.array_equal(lr_table(1e-3, 100, 10, "cosine", 0.1, decay_steps(100, 10, 1.0)),
                          lr_table(1e-3, 100, 10, "cosine", 0.1))
    # The decay never reaches into the warmup.
    assert decay_steps(10, 8, 0.5) == 2 and decay_steps(10, 10, 0.5) == 0


def test_the_default_schedule_holds_the_peak_and_decays_over_the_last_fifth():
    cfg = FinetuneConfig(storage_path="/tmp/unused").validate()
    parsed = build_parser().parse_args(["finetune"])
    assert cfg.decay_ratio == parsed.decay_ratio == 0.2
    assert (cfg.lr_schedule, cfg.warmup_ratio, cfg.min_lr_ratio) == ("cosine", 0.05, 0.1)
    with pytest.raises(ConfigError, match="--decay-ratio"):
        FinetuneConfig(storage_path="/tmp/unused", decay_ratio=0.0).validate()


def test_progress_events_become_status_progress_with_a_time_left():
    status: dict = {}
    apply_event(status, {"event": "plan", "total_steps": 300})
    assert status["progress"]["summary"] == "0% 0/300"
    event = {"event": "progress", "epoch": 1, "epochs": 3, "step": 75, "total_steps": 300, "epoch_step": 75,
             "epoch_steps": 100, "loss": 2.51234, "lr": 2e-5, "tokens_per_s": 12345.67, "step_time_s": 2.0,
             "grad_norm": 0.876543, "some_future_field": 1}
    apply_event(status, event)
    apply_event(status, event)  # idempotent
    progress = status["progress"]
    assert progress["percent"] == 25.0 and progress["etaSeconds"] == 450
    assert progress["summary"] == "25% 75/300 ETA 7m"
    assert (progress["loss"], progress["tokensPerSecond"], progress["epochStep"]) == (2.5123, 12345.7, 75)
    assert progress["gradNorm"] == 0.8765
    assert status["message"] == "epoch 1/3: step 75/300 loss=2.5123"
    apply_event(status, {"event": "result", "best_checkpoint_uri": "gs://b/r/epoch_0003"})
    assert status["progress"]["summary"] == "100% 300/300" and status["progress"]["etaSeconds"] == 0
    apply_event(status, {"event": "progress", "step": "x"})  # malformed: ignored
    assert status["progress"]["percent"] == 100.0


def test_the_status_schema_keeps_progress():
    from tpufinetune.core.status import TPUFineTuneStatus

    status: dict = {}
    apply_event(status, {"event": "progress", "epoch": 1, "epochs": 1, "step": 5, "total_steps": 10,
                         "loss": 1.0, "step_time_s": 0.5, "grad_norm": 2.5})
    dumped = TPUFineTuneStatus.model_validate(status).model_dump(by_alias=True, exclude_none=True)
    assert dumped["progress"] == status["progress"] and dumped["progress"]["gradNorm"] == 2.5
    event = {"event": "progress", "step": 6, "total_steps": 10, "grad_norm": 3.25}
    assert split_malformed({"phase": "Running"}, [event])[1] == []  # gradNorm is declared: not dropped
