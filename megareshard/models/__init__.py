"""Models built from the tensor-parallel layers; parameter names are global (``layers.17``)."""
from .gpt import GPTModel, check_gpt_config, gpt_flops_per_token, model_flops_per_iteration

__all__ = ["GPTModel", "check_gpt_config", "gpt_flops_per_token", "model_flops_per_iteration"]
