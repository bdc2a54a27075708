"""Megatron-LM flags that megareshard accepts without effect, and those it refuses as not built.

A launch script written for Megatron-LM passes flags of three kinds besides the ones megareshard
implements (``megareshard.arguments``):

* ``NO_EFFECT``: kernel fusions, data-loader and logging knobs, attention back-ends... that change
  nothing about what is computed here. They parse, and the run's first line names them with why.
* ``NOT_BUILT``: features megareshard does not have (fp8 / Transformer Engine,
  context parallelism, ...). A run that gives any of them stops with one message naming every one.
* ``NOT_BUILT_IF``: flags whose neutral value is fine (``--context-parallel-size 1``) and any other
  value is a feature not built.
* ``MAPPED``: older spellings of what megareshard has, applied as Megatron-LM applies them
  (``--use-rotary-position-embeddings``, ``--use-flash-attn``); the run's first line says what they became.

A flag already defined by megareshard's own parser is never shadowed by these tables.
"""
from __future__ import annotations

import argparse
from typing import Any, Sequence

from .config_fields import ConfigError

# flag -> (argparse kwargs, why it changes nothing here)
_FLAG = dict(action="store_true", default=None)
_INT = dict(type=int, default=None)
_STR = dict(type=str, default=None)
NO_EFFECT: dict[str, tuple[dict[str, Any], str]] = {
    "--use-mcore-models": (_FLAG, "there is one model implementation"),
    "--use-legacy-models": (_FLAG, "there is one model implementation"),
    "--transformer-impl": (dict(type=str, default=None, choices=("local", "transformer_engine")),
                           "layers are PyTorch modules"),
    "--masked-softmax-fusion": (_FLAG, "the masked softmax is fused by default (--no-masked-softmax-fusion "
                                       "turns it off)"),
    "--no-gradient-accumulation-fusion": (_FLAG, "weight gradients are accumulated by autograd, or added by the "
                                                 "delayed-W queue; there is no fused accumulating GEMM to turn off"),
    "--no-persist-layer-norm": (_FLAG, "apex's persistent LayerNorm kernel is not used (LayerNorm is PyTorch's, "
                                       "or apex's FusedLayerNorm; compiled with the layer under --torch-compile)"),
    "--no-async-tensor-model-parallel-allreduce": (_FLAG, "communication overlap detail"),
    "--tp-comm-overlap": (_FLAG, "communication overlap detail"),
    "--overlap-param-gather": (_FLAG, "updated parameter shards are all-gathered right after the step"),
    "--grad-reduce-in-bf16": (_FLAG, "gradients are reduced in fp32"),
    "--calculate-per-token-loss": (_FLAG, "the loss is already the mean over every token of the global batch"),
    "--num-workers": (_INT, "samples are read in the training process (memory-mapped)"),
    "--exit-signal-handler-for-dataloader": (_FLAG, "there are no data-loader worker processes to signal: samples are "
                                                    "read in the training process, whose --exit-signal-handler "
                                                    "covers them"),
    "--no-mmap-bin-files": (_FLAG, ".bin files are always memory-mapped"),
    "--no-create-attention-mask-in-dataloader": (_FLAG, "attention is causal without a mask tensor"),
    "--data-impl": (_STR, "the indexed dataset is always memory-mapped"),
    "--distributed-backend": (dict(type=str, default=None, choices=("nccl", "gloo")),
                              "nccl on GPUs, gloo on CPUs, chosen by the device"),
    "--tiktoken-pattern": (_STR, "for TikTokenizer only"),
    "--log-timers-to-tensorboard": (_FLAG, "iteration-time (seconds) is always written to TensorBoard; other "
                                           "timers are not"),
    "--log-validation-ppl-to-tensorboard": (_FLAG, "validation perplexity is always logged"),
    "--timing-log-level": (_INT, "not logged"),
    "--use-cpu-initialization": (_FLAG, "weights are initialised from the seed on their device"),
    "--check-for-nan-in-loss-and-grad": (_FLAG, "the check is on by default (--no-check-for-nan-in-loss-and-grad "
                                                "turns it off)"),
    "--accumulate-allreduce-grads-in-fp32": (_FLAG, "gradients are accumulated and reduced in fp32"),
    "--use-dist-ckpt": (_FLAG, "deprecated in Megatron-LM (see --ckpt-format): checkpoints are torch_dist already"),
    "--ckpt-fully-parallel-save": (_FLAG, "deprecated in Megatron-LM (its default): every rank writes its own "
                                          "shards"),
    "--fp16-lm-cross-entropy": (_FLAG, "the cross-entropy is computed in fp32 (--cross-entropy-loss-fusion chunks "
                                       "it instead)"),
}

# flags that name features megareshard does not have: flag -> (argparse kwargs, the feature)
NOT_BUILT: dict[str, tuple[dict[str, Any], str]] = {
    "--fp8-format": (_STR, "fp8 / Transformer Engine"),
    "--fp8-recipe": (_STR, "fp8 / Transformer Engine"),
    "--fp8-amax-history-len": (_INT, "fp8 / Transformer Engine"),
    "--fp8-amax-compute-algo": (_STR, "fp8 / Transformer Engine"),
    "--fp8-param-gather": (_FLAG, "fp8 / Transformer Engine"),
    "--fp8-margin": (_INT, "fp8 / Transformer Engine"),
    "--fp4-format": (_STR, "fp4"),
    "--rampup-batch-size": (dict(nargs="*", default=None), "batch-size ramp-up"),
    "--microbatch-group-size-per-virtual-pipeline-stage": (_INT, "microbatch groups other than pp per virtual "
                                                                 "pipeline stage (interleaving groups by pp)"),
    "--mtp-num-layers": (_INT, "multi-token prediction"),
    "--multi-latent-attention": (_FLAG, "multi-latent attention"),
    "--spec": (dict(nargs="*", default=None), "custom layer specs"),
    "--retro-project-dir": (_STR, "Retro"),
    "--tp-comm-overlap-cfg": (_STR, "Transformer Engine communication overlap"),
    "--eod-mask-loss": (_FLAG, "loss masking at end-of-document tokens"),
    "--reset-position-ids": (_FLAG, "position ids restarting at document boundaries"),
    "--reset-attention-mask": (_FLAG, "attention masks restarting at document boundaries"),
    "--no-save-optim": (_FLAG, "checkpoints without the optimizer state"),
    "--no-save-rng": (_FLAG, "checkpoints without the RNG state"),
    "--init-method-xavier-uniform": (_FLAG, "Xavier-uniform initialisation"),
    # model-architecture options: these entries only apply while the model does not define the flag
    "--group-query-attention": (_FLAG, "architecture: grouped-query attention"),
    "--num-query-groups": (_INT, "architecture: grouped-query attention"),
    "--kv-channels": (_INT, "architecture: a head size other than hidden / heads"),
    "--position-embedding-type": (_STR, "architecture: position embeddings other than learned"),
    "--rotary-base": (_INT, "architecture: rotary position embeddings"),
    "--rotary-percent": (dict(type=float, default=None), "architecture: rotary position embeddings"),
    "--rotary-seq-len-interpolation-factor": (_INT, "architecture: rotary position embeddings"),
    "--swiglu": (_FLAG, "architecture: SwiGLU MLP"),
    "--squared-relu": (_FLAG, "architecture: squared-ReLU MLP"),
    "--normalization": (_STR, "architecture: a normalization other than LayerNorm"),
    "--norm-epsilon": (dict(type=float, default=None), "architecture: the normalization epsilon"),
    "--untie-embeddings-and-output-weights": (_FLAG, "architecture: an output layer untied from the embedding"),
    "--disable-bias-linear": (_FLAG, "architecture: linear layers without biases"),
    "--add-qkv-bias": (_FLAG, "architecture: query/key/value biases only"),
    "--qk-layernorm": (_FLAG, "architecture: query/key normalization"),
}
# Megatron-LM's old spellings of features megareshard has, mapped as Megatron-LM's validate_args maps them
# (arguments.py and `apply_mapped_flags`): flag -> (argparse kwargs, what it means)
MAPPED: dict[str, tuple[dict[str, Any], str]] = {
    "--use-flash-attn": (_FLAG, "runs as --attention-backend flash"),
    "--use-rotary-position-embeddings": (_FLAG, "deprecated in Megatron-LM: sets --position-embedding-type rope"),
    "--no-position-embedding": (_FLAG, "deprecated in Megatron-LM: accepted with rotary embeddings only (which "
                                       "have no position-embedding table)"),
}

# families refused by prefix, whatever the flag's exact name
NOT_BUILT_PREFIXES = {"--moe-": "mixture of experts: an MoE option not built here", "--fp8-": "fp8 / Transformer Engine",
                      "--fp4-": "fp4", "--mtp-": "multi-token prediction", "--retro-": "Retro",
                      "--hybrid-": "hybrid (Mamba) models", "--mamba-": "hybrid (Mamba) models"}

# flags whose neutral value is accepted: flag -> (argparse kwargs, neutral value, the feature)
NOT_BUILT_IF: dict[str, tuple[dict[str, Any], Any, str]] = {
    "--context-parallel-size": (_INT, 1, "context parallelism"),
    "--encoder-pipeline-model-parallel-size": (_INT, 0, "encoder pipeline stages"),
    "--cross-entropy-fusion-impl": (_STR, "native", "Transformer Engine's cross-entropy"),
    "--optimizer": (_STR, "adam", "optimizers other than Adam with decoupled weight decay"),
    "--dist-ckpt-format": (_STR, "torch_dist", "checkpoint formats other than torch_dist"),
    "--dataloader-type": (_STR, "single", "the cyclic and external data loaders"),
}


def _dest(flag: str) -> str:
    return "megatron." + flag[2:].replace("-", "_")


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """Register every table's flags that ``parser`` does not define already."""
    have = set(parser._option_string_actions)  # argparse keeps no public list of option strings
    group = parser.add_argument_group("Megatron-LM flags without effect or not built here",
                                      "accepted so Megatron-LM launch scripts run unchanged; see docs/megatron.md")
    for table, what in ((NO_EFFECT, "no effect"), (NOT_BUILT, "refused"), (MAPPED, "mapped")):
        for flag, (kwargs, why) in table.items():
            if flag not in have:
                group.add_argument(flag, dest=_dest(flag), help=f"{what}: {why}", **kwargs)
    for flag, (kwargs, neutral, what) in NOT_BUILT_IF.items():
        if flag not in have:
            group.add_argument(flag, dest=_dest(flag), help=f"only {neutral} ({what} is not built)", **kwargs)


def given(ns: argparse.Namespace, flag: str) -> Any:
    """The value ``flag`` was given in ``ns`` (None when absent or not registered by this module)."""
    return getattr(ns, _dest(flag), None)


def no_effect_flags(ns: argparse.Namespace) -> list[str]:
    """'--flag (why)' for every no-effect flag given."""
    return [f"{flag} ({why})" for flag, (_, why) in NO_EFFECT.items() if given(ns, flag) is not None]


def apply_mapped_flags(ns: argparse.Namespace, model: Any, notes: list[str]) -> None:
    """Megatron-LM's old position-embedding flags on ``model`` (a ModelConfig), as Megatron-LM's validate_args
    applies them: ``--use-rotary-position-embeddings`` sets rope (whatever --position-embedding-type says), and
    ``--no-position-embedding`` is refused unless the type is then rope. Appends a note per flag given."""
    if given(ns, "--use-rotary-position-embeddings"):
        if model.position_embedding_type != "rope":
            notes.append(f"--use-rotary-position-embeddings (sets --position-embedding-type rope, replacing "
                         f"{model.position_embedding_type}, as Megatron-LM does)")
            model.position_embedding_type = "rope"
        else:
            notes.append("--use-rotary-position-embeddings (the same as --position-embedding-type rope)")
    if given(ns, "--no-position-embedding"):
        if model.position_embedding_type != "rope":
            raise ConfigError(f"--no-position-embedding is deprecated and, as in Megatron-LM, only accepted with "
                              f"rotary embeddings, not with --position-embedding-type "
                              f"{model.position_embedding_type}: use --position-embedding-type none (or rope)")
        notes.append("--no-position-embedding (rotary embeddings have no position-embedding table)")


def refusals(ns: argparse.Namespace, unknown: Sequence[str]) -> tuple[list[str], list[str]]:
    """(not built: '--flag: feature', unknown flags) for the parsed namespace and argparse's leftovers."""
    refused = [f"{flag} ({what})" for flag, (_, what) in NOT_BUILT.items() if given(ns, flag) is not None]
    for flag, (_, neutral, what) in NOT_BUILT_IF.items():
        value = given(ns, flag)
        if value is not None and value != neutral:
            refused.append(f"{flag} {value} ({what}; only {neutral} is accepted)")
    strange = []
    for tok in unknown:
        if not tok.startswith("--"):
            continue
        name = tok.split("=", 1)[0]
        family = next((what for p, what in NOT_BUILT_PREFIXES.items() if name.startswith(p)), None)
        if family is not None:
            refused.append(f"{name} ({family})")
        else:
            strange.append(name)
    return refused, strange
