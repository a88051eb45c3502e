"""Training methods: what a run trains and how a micro-batch becomes its loss.

`sft.py` (supervised fine-tuning, full or LoRA) and `dpo.py` (direct preference
optimisation) each say, for the loop in train.py: what is trainable, how a micro-batch
becomes a loss, what reference (if any) it needs, what it reports per epoch, and what its
checkpoint and export hold. `dpo_loss.py` is DPO's pure loss (no model, no I/O)."""


def for_config(cfg):
    """The run's method object: the one place a method is chosen."""
    from .dpo import DPO
    from .sft import SFT

    if getattr(cfg, "multimodal", False):
        from .media_sft import MediaSFT

        return MediaSFT(cfg)
    return DPO(cfg) if cfg.method == "dpo" else SFT(cfg)
