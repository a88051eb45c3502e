"""status.plan made again from the model's own config.json, once the trainer has read it
(its `model` event, emitted before any weight is loaded): the config's widths win over the
planner's table, status.plan says where they came from, and a model that cannot fit is
stopped before it trains (core/phasechecks.plan_from_config)."""

from datetime import timedelta

from phase_helpers import IDENT, READY, kinds, running_status, step
from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.core.api import parse_spec
from tpufinetune.core.phases import JobView
from tpufinetune.core.status import checked_status
from tpufinetune_trainer.events import KINDS, parse_line, format_event
from tpufinetune_trainer.model import config_report


def _plan(model: str = "google/gemma-4-E2B-it", topology: str = "4x4", **training):
    spec = parse_spec({"tpu": {"generation": "v6e", "topology": topology}, "image": "img", "model": {"id": model},
                       "checkpoint": {"storagePath": "gs://bucket/ckpt"}, "training": training})
    return phases.plan_for(IDENT, spec, timedelta(minutes=30))


def _gemma4_config(**text):
    """A Gemma 4 config as transformers makes it (the trainer's config_report reads it)."""
    from transformers import Gemma4Config, Gemma4TextConfig

    return Gemma4Config(text_config=Gemma4TextConfig(**text).to_dict())


def _model_event(config) -> dict:
    """The event as it crosses the log: formatted by the trainer, parsed by the operator."""
    return parse_line(format_event("model", config=config_report(config)))


def test_the_model_event_is_one_the_protocol_knows():
    assert "model" in KINDS


def test_a_config_that_agrees_keeps_the_run_going_and_names_the_config():
    plan = _plan()
    status = running_status(plan=plan)
    assert status["plan"]["basis"] == "table" and "gemma.cpp" in status["plan"]["widthsFrom"]
    # E2B's widths as the table has them (gemma.cpp's MLP averaged over its 35 layers).
    config = _gemma4_config(num_hidden_layers=35, hidden_size=1536, intermediate_size=9654,
                            num_attention_heads=8, num_key_value_heads=4, vocab_size=262144)
    d = step(status, plan=plan, cluster=READY, job=JobView("RUNNING"), events=(_model_event(config),))
    assert d.phase == phases.RUNNING
    planned = d.status["plan"]
    assert planned["basis"] == "config" and "config.json" in planned["widthsFrom"]
    assert planned["modelConfig"]["hiddenSize"] == 1536 and planned["modelConfig"]["numHiddenLayers"] == 35
    assert planned["modelConfig"]["fullAttentionLayers"] == 6  # every sixth of 35, and the last
    assert planned["fits"] is True
    assert "PlannedFromModelConfig" in [a.reason for a in d.actions if isinstance(a, phases.RecordEvent)]
    assert checked_status(d.status) is d.status  # every key is declared
    # The same event read again (a restarted operator re-reads the log) changes nothing.
    again = step(d.status, plan=plan, cluster=READY, job=JobView("RUNNING"), events=(_model_event(config),))
    assert again.status["plan"] == planned and "RecordEvent" not in kinds(again)


def test_a_config_wider_than_the_table_stops_the_run_before_it_trains():
    plan = _plan()
    status = running_status(plan=plan)
    assert status["plan"]["fits"] is True
    # The same name, a model twice as wide: it cannot fit a v6e chip.
    config = _gemma4_config(num_hidden_layers=35, hidden_size=3072, intermediate_size=19308,
                            num_attention_heads=16, num_key_value_heads=8, vocab_size=262144)
    d = step(status, plan=plan, cluster=READY, job=JobView("RUNNING"), events=(_model_event(config),))
    failed = cond.find(d.status, cond.FAILED)
    assert failed is not None and failed["reason"] == "DoesNotFit"
    assert "config.json" in failed["message"] and "GiB of HBM per chip" in failed["message"]
    assert phases.StopJob(status["jobId"]) in d.actions
    assert d.status["plan"]["fits"] is False and d.status["plan"]["basis"] == "config"


def test_an_unknown_model_is_planned_once_its_config_is_read_and_never_refused_on_the_cpu_stand_in():
    spec = parse_spec({"tpu": {"generation": "cpu", "topology": "2"}, "image": "img",
                       "model": {"id": "gs://bucket/models/tiny"}, "checkpoint": {"storagePath": "gs://bucket/ckpt"}})
    plan = phases.plan_for(IDENT, spec, timedelta(minutes=30))
    status = running_status(plan=plan)
    assert status["plan"]["basis"] == "unknown"
    config = _gemma4_config(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, vocab_size=512)
    d = step(status, plan=plan, cluster=READY, job=JobView("RUNNING"), events=(_model_event(config),))
    assert d.phase == phases.RUNNING
    assert d.status["plan"]["basis"] == "config" and d.status["plan"]["hostRAMBytes"] > 0
    assert d.status["plan"]["modelConfig"]["vocabSize"] == 512


def test_a_malformed_config_changes_nothing():
    plan = _plan()
    status = running_status(plan=plan)
    for config in ({"hidden_size": "wide"}, {"hidden_size": 0, "num_hidden_layers": 2, "num_attention_heads": 2,
                                             "vocab_size": 8}, "not a dict", {"num_hidden_layers": True}):
        d = step(status, plan=plan, cluster=READY, job=JobView("RUNNING"),
                 events=({"event": "model", "v": 1, "config": config},))
        assert d.status["plan"] == status["plan"] and d.phase == phases.RUNNING


def test_a_multimodal_runs_plan_counts_the_vision_tower_its_model_event_reports():
    """A model the table does not know (the ground's tiny multimodal Gemma 4, named by its
    bucket path) gets status.plan.towers from its own vision_config and its processor's
    tokens per image, as the trainer read them."""
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel

    spec = parse_spec({"tpu": {"generation": "cpu", "topology": "2"}, "image": "img",
                       "model": {"id": "gs://bucket/models/tiny-vision"}, "checkpoint": {"storagePath": "gs://b/c"},
                       "training": {"towers": {"vision": "frozen"}, "maxSeqLen": 256}})
    plan = phases.plan_for(IDENT, spec, timedelta(minutes=30))
    status = running_status(plan=plan)
    assert not (status.get("plan") or {}).get("towers")  # nothing known of the model yet
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, position_embedding_size=64)
    config = Gemma4Config(text_config=Gemma4TextConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                                       num_attention_heads=2, num_key_value_heads=1,
                                                       vocab_size=512).to_dict(),
                          vision_config=Gemma4VisionConfig(**vision).to_dict())

    class ImageProcessor:
        max_soft_tokens = 70

    event = parse_line(format_event("model", config=config_report(config, ImageProcessor())))
    d = step(status, plan=plan, cluster=READY, job=JobView("RUNNING"), events=(event,))
    towers = d.status["plan"]["towers"]
    expected = sum(p.numel() for p in Gemma4VisionModel(Gemma4VisionConfig(**vision)).parameters())
    assert towers["vision"] == "frozen" and towers["visionParameters"] == expected
    assert towers["tokensPerImage"] == 72  # its 70 soft tokens and the two boundaries
    assert "config.json" in towers["widthsFrom"]
    assert "vision" not in d.status["plan"]["modelConfig"]
    assert checked_status(d.status) is d.status
