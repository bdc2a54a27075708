"""Live weight transfer (issue #50): a model's parameters from a training layout to destination replicas in
other layouts, planned by the resharding library (`plan.py`, pure) and run over a caller's process group
(`execute.py`). The trainer-facing API is `megareshard.transfer`."""
from .boxes import Box, ParamInfo, even_layer_ranges, layout_boxes
from .plan import Bucket, Replica, TransferPlan, clear_plan_cache, decompose_boxes, plan_weight_transfer

__all__ = ["Box", "ParamInfo", "layout_boxes", "even_layer_ranges", "Replica", "Bucket", "TransferPlan",
           "plan_weight_transfer", "decompose_boxes", "clear_plan_cache", "TransferExecutor"]


def __getattr__(name):  # the executor imports torch.distributed: only when asked for
    if name == "TransferExecutor":
        from .execute import TransferExecutor
        return TransferExecutor
    raise AttributeError(name)
