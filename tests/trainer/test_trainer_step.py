"""The training step in one process (a real world-size-1 gloo group): the TPU's dtype
policy run on CPU, token-weighted loss, masks, no host reads, compile parity."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from tpufinetune_trainer.data import encode_rows, load_rows, pack
from tpufinetune_trainer.masks import MaskBuilder
from tpufinetune_trainer.model import decoder_blocks, load_causal_lm, load_tokenizer
from tpufinetune_trainer.train import Trainer
from trainer_helpers import BLOCK_LENGTH, make_trainer

LENGTH = BLOCK_LENGTH


def run_steps(trainer: Trainer, steps: int) -> list[float]:
    """Mean loss per optimizer step, the epoch's next steps (read after each step: this is
    a test, not the loop)."""
    losses, loss_sum = [], torch.zeros(())
    for _ in range(steps):
        count = int(trainer.epoch_plan.label_tokens[trainer.epoch_step])
        before = float(loss_sum)
        trainer.train_step(loss_sum)
        trainer.epoch_step += 1
        losses.append((float(loss_sum) - before) / count)
    return losses


def test_the_tpu_dtype_policy_on_cpu(trainer_assets, prepared, process_group, tmp_path):
    """bf16 compute, fp32 master weights and AdamW state, the frozen table stored in bf16:
    the numerics a TPU runs, here on the CPU suite."""
    from torch.distributed.tensor import DTensor

    trainer = make_trainer(trainer_assets.model, prepared, tmp_path, compute_dtype="bfloat16")
    model = trainer.model
    table = model.model.language_model.embed_tokens_per_layer.weight
    assert table.dtype == torch.bfloat16 and not table.requires_grad and not isinstance(table, DTensor)
    assert {p.dtype for p in trainer.params} == {torch.float32}
    seen = {}

    def block_output(module, args, out) -> None:
        seen.setdefault("block", out.dtype)

    hook = model.model.language_model.layers[0].register_forward_hook(block_output)
    losses = run_steps(trainer, 8)
    hook.remove()
    assert seen["block"] == torch.bfloat16  # the blocks compute in bf16
    state = trainer.optimizer.state[trainer.params[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.3, losses
    assert trainer.lr.dtype == torch.float32 and trainer.optimizer.param_groups[0]["lr"] is trainer.lr


def step_gradients(trainer: Trainer) -> list[torch.Tensor]:
    """The gradients one train_step produces (optimizer step and zeroing held back)."""
    trainer.optimizer.step = lambda *a, **k: None
    trainer.optimizer.zero_grad = lambda *a, **k: None
    trainer.train_step(torch.zeros(()))  # step 0 of epoch 1
    return [p.grad.full_tensor() for p in trainer.params]


def test_every_label_token_weighs_the_same_however_the_batch_is_split(trainer_assets, prepared,
                                                                      process_group, tmp_path):
    """One global batch of 4 examples, as 1 micro-batch or 4 accumulated micro-batches:
    the same gradient, because the loss is the global token sum over the global token
    count, not a mean of per-batch means (the examples hold different numbers of label
    tokens, so a mean of means would weigh their tokens differently)."""
    whole = make_trainer(trainer_assets.model, prepared, tmp_path, batch_size_per_device=4, max_grad_norm=0)
    split = make_trainer(trainer_assets.model, prepared, tmp_path, batch_size_per_device=1, global_batch_examples=4,
                         max_grad_norm=0)
    assert (whole.plan.accum, split.plan.accum) == (1, 4)
    examples = [e for b in whole.epoch_plan.slots[0].reshape(-1) if b >= 0 for e in whole.epoch_plan.blocks[b]]
    assert len(examples) == 4 and len(set(whole.examples.label_tokens[examples].tolist())) > 1
    for a, b in zip(step_gradients(whole), step_gradients(split)):
        assert torch.linalg.vector_norm(a - b) <= 1e-5 * torch.linalg.vector_norm(a)  # summation order only


def test_the_learning_rate_follows_the_schedule_from_the_device_table(trainer_assets, prepared, process_group,
                                                                      tmp_path):
    trainer = make_trainer(trainer_assets.model, prepared, tmp_path, warmup_ratio=0.25, num_epochs=2)
    seen = []
    for _ in range(4):
        trainer.train_step(torch.zeros(()))
        seen.append(float(trainer.lr))
    np.testing.assert_allclose(seen, trainer.lr_host[:4], rtol=1e-6)
    assert seen[0] < seen[1] < seen[2]  # warmup


@contextlib.contextmanager
def no_host_reads():
    """Fail on any read of a tensor's value into Python (what makes a TPU host wait)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    names = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    for name in names:
        setattr(torch.Tensor, name, refuse)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def test_forward_and_backward_never_read_a_tensor_on_the_host(trainer_assets, prepared, process_group, tmp_path):
    """transformers reads a device value to detect packing when it builds masks itself;
    with our masks passed in, the step's forward and backward read nothing (the loss head
    gathers its label rows on the device, too)."""
    trainer = make_trainer(trainer_assets.model, prepared, tmp_path)
    trainer.load_window()
    index = torch.arange(trainer.plan.blocks)  # step 0's micro-batch
    batch = trainer.train_blocks.gather(index)
    assert trainer.label_head and trainer.train_cap < batch["targets"].numel()  # rows are gathered
    trainer.token_loss_sum(batch, trainer.train_cap).backward()  # warm-up outside the guard (lazy inits)
    with no_host_reads():
        loss = trainer.token_loss_sum(trainer.train_blocks.gather(index), trainer.train_cap)
        loss.backward()
    with pytest.raises(AssertionError, match="read on the host"):
        with no_host_reads():
            trainer.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])  # no masks


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_our_masks_give_each_packed_example_its_logits_alone(trainer_assets, attn):
    model = load_causal_lm(str(trainer_assets.model), torch.float32, attn).eval()
    tokenizer = load_tokenizer(str(trainer_assets.model))
    enc = encode_rows(load_rows(str(trainer_assets.data), "train[:40]"), tokenizer, LENGTH, "chat")
    packed = pack(enc.input_ids, enc.labels, LENGTH, tokenizer.pad_token_id)
    block = int(np.argmax(packed.segment_ids.max(axis=1)))  # the block with the most examples
    masks = MaskBuilder(model.config, LENGTH, torch.device("cpu"), torch.float32, attn)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(packed.input_ids[block:block + 1]),
                       position_ids=torch.from_numpy(packed.position_ids[block:block + 1]),
                       attention_mask=masks(torch.from_numpy(packed.segment_ids[block:block + 1]))).logits[0]
        checked = 0
        for segment in range(1, int(packed.segment_ids[block].max())):
            where = np.flatnonzero(packed.segment_ids[block] == segment)
            alone = model(input_ids=torch.from_numpy(packed.input_ids[block, where][None])).logits[0]
            torch.testing.assert_close(logits[where], alone, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 2


def test_a_long_example_sees_only_the_sliding_window_on_sliding_layers(trainer_assets):
    model = load_causal_lm(str(trainer_assets.model), torch.float32, "sdpa").eval()
    window = model.config.get_text_config().sliding_window
    length = window + 64
    ids = torch.randint(6, 1000, (1, length))
    masks = MaskBuilder(model.config, length, torch.device("cpu"), torch.float32, "sdpa")
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=masks(torch.ones(1, length, dtype=torch.long))).logits
        theirs = model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_blocks_match_eager_and_stay_compiled_in_evaluation(trainer_assets, prepared, process_group,
                                                                     tmp_path, monkeypatch):
    """Compiled blocks train as eager ones do, and evaluation (grad mode off, one of
    dynamo's guards: new graphs for the same blocks) compiles too instead of running past
    dynamo's recompile limit eager. Dynamo's limit is set to 1 here, below what this tiny
    model's block kinds need in two modes, as E2B's six kinds in three modes are above the
    default 8 (docs/trainer.md, "On a GPU"): compile_blocks raises it for the blocks."""
    import logging

    import torch._dynamo
    from torch._dynamo.utils import counters

    eager = run_steps(make_trainer(trainer_assets.model, prepared, tmp_path, compile="off"), 3)
    eager_eval = make_trainer(trainer_assets.model, prepared, tmp_path, compile="off")
    run_steps(eager_eval, 3)
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    limit_hits = []

    class Watch(logging.Handler):
        def emit(self, record):
            if "recompile_limit" in record.getMessage():
                limit_hits.append(record.getMessage())

    watch = Watch()
    logging.getLogger("torch._dynamo").addHandler(watch)
    try:
        compiled_trainer = make_trainer(trainer_assets.model, prepared, tmp_path, compile="on")
        assert compiled_trainer.compiled
        compiled = run_steps(compiled_trainer, 3)
        trained_graphs = counters["stats"]["unique_graphs"]
        evaluated = compiled_trainer.evaluate()
    finally:
        logging.getLogger("torch._dynamo").removeHandler(watch)
    np.testing.assert_allclose(compiled, eager, rtol=2e-3, atol=2e-3)
    assert not limit_hits, limit_hits[:2]
    assert counters["stats"]["unique_graphs"] > trained_graphs  # evaluation's own graphs
    np.testing.assert_allclose(evaluated, eager_eval.evaluate(), rtol=2e-3, atol=2e-3)


def test_a_checkpoint_loads_in_place_from_a_uri(trainer_assets, prepared, process_group, tmp_path):
    """A URI (here file://, as gs:// in production) is read through pyarrow's file system,
    shard byte ranges in place, never downloaded as a whole directory first."""
    from tpufinetune_trainer import checkpoint as ckpt

    trainer = make_trainer(trainer_assets.model, prepared, tmp_path)
    run_steps(trainer, 2)
    saved = [p.detach().full_tensor().clone() for p in trainer.params]
    ckpt.save_sharded(trainer.model, trainer.optimizer, str(tmp_path / "ckpt"), {"epoch": 1, "epoch_step": 2},
                      trainer.cpu_group)
    run_steps(trainer, 1)  # move away from the saved state
    assert not torch.equal(saved[0], trainer.params[0].detach().full_tensor())
    state = ckpt.load_sharded(trainer.model, trainer.optimizer, f"file://{tmp_path / 'ckpt'}", trainer.cpu_group)
    assert state == {"epoch": 1, "epoch_step": 2}
    for before, param in zip(saved, trainer.params):
        assert torch.equal(before, param.detach().full_tensor())
    assert isinstance(ckpt.storage_reader("gs://bucket/run/step_0000010"), ckpt.ArrowReader)


def test_early_stopping_counts_evaluations_without_a_lower_eval_loss(trainer_assets, prepared, process_group,
                                                                     tmp_path):
    trainer = make_trainer(trainer_assets.model, prepared, tmp_path, early_stopping_patience=3)
    for step, eval_loss in enumerate([3.0, 2.5, 2.6, 2.5], start=1):
        trainer.global_step = step
        trainer.early_stop_check(eval_loss)
        assert trainer.stopped is None, (step, trainer.stopped)
        trainer.history.append({"step": step, "eval_loss": eval_loss, "uri": f"s{step}"})
    trainer.global_step = 5
    trainer.early_stop_check(2.7)  # the third evaluation in a row not below the best (2.5)
    assert trainer.stopped["reason"] == "Patience" and trainer.stopped["best_eval_loss"] == 2.5
    assert trainer.stopped["step"] == 5


def test_a_target_eval_loss_stops_at_the_first_evaluation_that_reaches_it(trainer_assets, prepared, process_group,
                                                                          tmp_path):
    trainer = make_trainer(trainer_assets.model, prepared, tmp_path, target_eval_loss=2.0)
    trainer.training_s_before = 100.0  # earlier attempts' training, as a resumed run reads it
    trainer.global_step, trainer.epoch = 7, 1
    trainer.early_stop_check(2.01)
    assert trainer.stopped is None
    earliest = trainer.training_s()
    trainer.early_stop_check(2.0)
    latest = trainer.training_s()
    stopped = trainer.stopped
    assert stopped["reason"] == "TargetEvalLoss" and stopped["target_eval_loss"] == 2.0
    assert (stopped["eval_loss"], stopped["step"], stopped["epoch"]) == (2.0, 7, 1)
    # Every attempt's seconds of training at the deciding evaluation (rounded to 1 ms).
    assert round(earliest, 3) <= stopped["training_s"] <= round(latest, 3), (earliest, stopped, latest)


def test_the_export_is_in_the_bases_dtype_with_its_other_files_from_a_checkpoint_that_exists(
        trainer_assets, prepared, process_group, tmp_path, capsys):
    """A run resumed from an earlier run whose --keep-checkpoints deleted the best
    checkpoint since: the export falls back to the newest complete one of this run and
    says why; it is saved in the base's dtype (bf16 here) and carries the base's other
    files (a processor config the trainer never writes) and its vision and audio towers."""
    import json
    import shutil

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tpufinetune_trainer import checkpoint as ckpt
    from tpufinetune_trainer.events import parse_text

    base = tmp_path / "base"
    shutil.copytree(trainer_assets.model, base)
    config = json.loads((base / "config.json").read_text())
    config["dtype"] = "bfloat16"  # as google/gemma-4-*-it ship
    (base / "config.json").write_text(json.dumps(config))
    (base / "processor_config.json").write_text('{"processor_class": "Gemma4Processor"}')
    trainer = make_trainer(trainer_assets.model, prepared, tmp_path / "storage", model_id=str(base), run_name="resumed")
    run_steps(trainer, 2)
    newest = tmp_path / "storage" / "resumed" / "step_0000002"
    gone = {"epoch": 1, "step": 1, "loss": 1.0, "eval_loss": 1.0, "uri": str(tmp_path / "storage" / "first" / "x")}
    entry = {"epoch": 1, "step": 2, "loss": 3.0, "eval_loss": 3.0, "uri": str(newest)}
    ckpt.save_sharded(trainer.model, trainer.optimizer, str(newest), {"epoch": 1, "step": 2, "history": [gone, entry]},
                      trainer.cpu_group)
    names = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    saved = {name: p.detach().full_tensor().clone() for name, p in zip(names, trainer.params)}
    run_steps(trainer, 1)  # the model now holds weights no checkpoint has
    trainer.history, trainer.weights_uri = [gone, entry], None
    capsys.readouterr()
    trainer.export()
    out = capsys.readouterr().out
    result = next(e for e in parse_text(out) if e.kind == "result")
    assert result["best_checkpoint_uri"] == str(newest) and result["best_step"] == 2
    assert f"The best checkpoint {gone['uri']} (eval_loss=1.0) is gone or incomplete" in out
    export = tmp_path / "storage" / "resumed" / "export"
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    assert (export / "processor_config.json").read_text() == (base / "processor_config.json").read_text()
    assert "processor_config.json" in out
    with safe_open(export / "model.safetensors", "pt") as f:
        keys = list(f.keys())
        assert {f.get_tensor(k).dtype for k in keys} == {torch.bfloat16}
        compared = [k for k in keys if k in saved]
        assert len(compared) > 10
        for key in compared:  # the fallback checkpoint's weights, rounded to bf16
            assert torch.equal(f.get_tensor(key), saved[key].to(torch.bfloat16)), key
        towers = [k for k in keys if ".vision_tower." in k or ".audio_tower." in k]
        assert towers  # the multimodal base's towers, untouched by the fine-tune
        with safe_open(base / "model.safetensors", "pt") as b:
            for key in towers:
                assert torch.equal(f.get_tensor(key), b.get_tensor(key).to(torch.bfloat16)), key
    exported_config = json.loads((export / "config.json").read_text())
    assert exported_config["vision_config"] and exported_config["audio_config"]
    model = AutoModelForCausalLM.from_pretrained(export)  # the base's multimodal model, as a drop-in
    assert model.model.vision_tower is not None and model.model.audio_tower is not None
    assert next(model.parameters()).dtype == torch.bfloat16


def test_no_weight_decay_on_norm_scales_and_biases(trainer_assets, prepared, process_group, tmp_path):
    trainer = make_trainer(trainer_assets.model, prepared, tmp_path, weight_decay=0.05)
    groups = trainer.optimizer.param_groups
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    grouped = [(names[id(p)], p.ndim, g["weight_decay"]) for g in groups for p in g["params"]]
    assert sorted(n for n, _, _ in grouped) == sorted(names[id(p)] for p in trainer.params)  # each once
    for name, ndim, decay in grouped:
        assert decay == (0.05 if ndim >= 2 else 0.0), (name, ndim, decay)
    assert any("norm" in n and d == 0.0 for n, _, d in grouped)
    assert any(ndim >= 2 and d == 0.05 for _, ndim, d in grouped)


def test_token_ids_reach_the_device_as_int32(trainer_assets, prepared, process_group, tmp_path):
    trainer = make_trainer(trainer_assets.model, prepared, tmp_path)
    trainer.load_window()
    batch = trainer.train_blocks.gather(torch.tensor([0, 1]))
    assert {name: t.dtype for name, t in batch.items()} == dict.fromkeys(
        ("input_ids", "targets", "position_ids", "segment_ids"), torch.int32)
    losses = run_steps(trainer, 2)  # the model takes them
    assert all(np.isfinite(losses))


def test_an_epoch_reaches_the_device_a_window_at_a_time_and_a_resumed_epoch_takes_the_same_steps(
        trainer_assets, prepared, process_group, tmp_path, monkeypatch):
    """The loop copies a window of steps' packed blocks and inputs to the device in one copy
    each and selects each step's row there (bit-identical to running the steps one by one,
    across a window's end); an epoch resumed at step 2 takes exactly the uninterrupted
    epoch's steps 2, 3, …"""
    steps, window = 5, 2
    table = make_trainer(trainer_assets.model, prepared, tmp_path, max_steps=steps)
    per_step = make_trainer(trainer_assets.model, prepared, tmp_path, max_steps=steps)
    table.window_steps = window
    copies, from_numpy = [], torch.from_numpy
    monkeypatch.setattr(torch, "from_numpy", lambda array: copies.append(array.shape) or from_numpy(array))
    metrics = table.train_epoch()
    monkeypatch.undo()
    plan = table.plan
    rows = window * plan.accum * plan.blocks
    assert table.global_step == steps and table.epoch_steps >= 3 * window  # three whole windows
    # Per window, one copy each of this rank's blocks of its steps (4 arrays, plus a filler
    # block) and of the table of [steps, block indices + the global label count]: 3 windows.
    one = [(rows + 1, LENGTH)] * 4 + [(window, plan.accum * plan.blocks + 1)]
    assert copies == one * 3, copies
    assert table.window is None and table.train_blocks is None  # the epoch's end frees its blocks
    loss_sum = torch.zeros(())
    for _ in range(steps):  # a window of the whole epoch
        per_step.train_step(loss_sum)
        per_step.epoch_step += 1
    assert per_step.window == (per_step.epoch, 0, per_step.epoch_steps)
    assert metrics["epoch_loss_sum"] == float(loss_sum)
    for a, b in zip(table.params, per_step.params):
        assert torch.equal(a.detach().full_tensor(), b.detach().full_tensor())
    assert table.evaluate() == per_step.evaluate()
    whole = make_trainer(trainer_assets.model, prepared, tmp_path)
    whole.load_window()
    resumed = make_trainer(trainer_assets.model, prepared, tmp_path)
    resumed.epoch_step = 2
    resumed.load_window()
    assert int(resumed.epoch_row) == 0 and resumed.window == (resumed.epoch, 2, whole.epoch_steps)
    assert torch.equal(resumed.epoch_inputs[:whole.epoch_steps - 2, -1], whole.epoch_inputs[2:, -1])
    for step in range(2, table.epoch_steps):
        index = whole.epoch_inputs[step, :-1]
        a, b = whole.train_blocks.gather(index), resumed.train_blocks.gather(resumed.epoch_inputs[step - 2, :-1])
        assert all(torch.equal(a[name], b[name]) for name in a)


def test_blocks_kept_gathered_after_forward_train_the_same(trainer_assets, prepared, process_group, tmp_path):
    """--reshard-after-forward false (what the operator passes where the plan holds it):
    each block's FSDP group keeps its gathered parameters for the backward, and the steps'
    losses are the default's, bit for bit (the same arithmetic, one all-gather fewer)."""
    losses = {}
    for reshard in (True, False):
        trainer = make_trainer(trainer_assets.model, prepared, tmp_path / str(reshard), reshard_after_forward=reshard)
        groups = [block._get_fsdp_state()._fsdp_param_group for block in decoder_blocks(trainer.model)]
        # FSDP2 reshards after forward to its post-forward mesh; None keeps the gathered copy.
        assert groups and all((group.post_forward_mesh_info is not None) == reshard for group in groups)
        losses[reshard] = run_steps(trainer, 3)
    assert losses[True] == losses[False]
