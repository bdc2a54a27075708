"""Models built from the tensor-parallel layers; parameter names are global (``layers.17``)."""
from .config import ModelConfig, check_model_shape
from .gpt import GPTModel, check_gpt_config, gpt_flops_per_token, model_flops_per_iteration

__all__ = ["ModelConfig", "check_model_shape", "GPTModel", "check_gpt_config", "gpt_flops_per_token",
           "model_flops_per_iteration"]
