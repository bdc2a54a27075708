"""The forward step shared by the causal language models (GPT, U-Transformer): a `ModelSpec` base.

A microbatch is the data pipeline's ``{"tokens": [b, s + 1]}`` (``data.sampler.collate``): the
first stage reads ``tokens[:, :-1]``, the last stage predicts ``tokens[:, 1:]`` and returns
per-token losses ``[b, s]``; the step's loss is their mean over every token of the step, so each
microbatch contributes ``mean / m`` for ``m`` microbatches (every layout computes the same number).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..model_spec.protocol import ModelSpec

__all__ = ["CausalLMSpec"]


class CausalLMSpec(ModelSpec):
    """`ModelSpec.model_inputs` and `ModelSpec.loss` of a causal language model over token batches.

    The module takes ``tokens`` (first stage), ``labels`` (last stage), ``hidden`` (the chain
    edge's tensor, later stages) and ``skips={edge name: tensor}`` (skip edges, when there are any).
    """

    def model_inputs(self, batch: dict[str, torch.Tensor], device: torch.device,
                     received: Mapping[str, torch.Tensor], *, first: bool, last: bool) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"hidden": received.get("")}
        skips = {name: t for name, t in received.items() if name != ""}
        if skips:
            kwargs["skips"] = skips
        if first or last:
            tokens = batch["tokens"].to(device, non_blocking=True)
            if first:
                kwargs["tokens"] = tokens[:, :-1].contiguous()
            if last:
                kwargs["labels"] = tokens[:, 1:].contiguous()
        return kwargs

    def loss(self, output: torch.Tensor, num_microbatches: int) -> torch.Tensor:
        """Mean per-token loss of the microbatch (fp32) over the step's microbatch count."""
        return output.float().mean() / num_microbatches
