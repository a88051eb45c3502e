"""TPUFineTune trainer: the payload the operator submits to a RayCluster.

`tpufinetune-train finetune` (Ray Train + FSDP2) and `tpufinetune-train collectives`
(Ray Core + DTensor). The operator imports `tpufinetune_trainer.events` without the
training stack installed, so nothing here may import torch or Ray.
"""

__version__ = "0.1.0"
