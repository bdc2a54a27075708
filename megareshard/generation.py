"""Text generation from a checkpoint of any layout, in one process: greedy or top-p sampling.

    model, cfg = load_for_generation("runs/x")          # the checkpoint root (its latest) or a directory
    ids = generate_ids(model, cfg, prompt_ids, max_new_tokens=20, top_p=0.9, temperature=0.8, seed=0)

The checkpoint's full tensors are read whatever layout saved them (tp, pp, dp, ZeRO: every
piece is described by its global box), so no process group is needed; a Megatron-LM checkpoint
directory (torch_dist or per-rank torch files) is read as ``pretrain_gpt.py --load`` reads it.
No key/value cache: each new token runs the whole (truncated) context — meant for looking at
what a fine-tune did, not for serving. An MoE checkpoint of any expert layout (ep, etp: each expert tensor is read
whole) routes dropless here, whatever capacity factor it trained with (``models/moe/layer.py`` ``route_dropless``).
"""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import torch
from .checkpoint import CheckpointError, read_full_model, read_info, resolve_checkpoint_dir
from .data.tokenizer import tokenizer_record
from .models import GPTModel, ModelConfig
from .models.config import KERNEL_FIELDS
from .models.moe import route_dropless
from .parallel import ParallelContext

__all__ = ["read_model_weights", "load_for_generation", "generate_ids", "recorded_tokenizer", "TOKENIZER_FLAGS",
           "megatron_dir"]

#: Megatron-LM's tokenizer flags (argparse names), in the order ``tokenizer_record`` reads the first four
TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")


def recorded_tokenizer(info: dict) -> dict | None:
    """The tokenizer a checkpoint's ``checkpoint.json`` (``info``) records (type, absolute paths); for one saved
    before it recorded them, the tokenizer flags of its arguments (paths as the run gave them); None when it has
    neither."""
    if info.get("tokenizer"):
        return info["tokenizer"]
    data = (info.get("args") or {}).get("data") if isinstance(info.get("args"), dict) else None
    if not data:
        return None
    return tokenizer_record(SimpleNamespace(**{k: data.get(k) for k in TOKENIZER_FLAGS[:4]}))


def megatron_dir(path: str) -> str | None:
    """The iteration directory when ``path`` names a Megatron-LM checkpoint (not a megareshard one), else None."""
    if not os.path.isdir(path):
        return None
    from .checkpoint.megatron_load import megatron_checkpoint_dir
    return megatron_checkpoint_dir(path)


def read_model_weights(path: str, vocab_size: int | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model configuration a checkpoint recorded and its full (unpadded) weights by name. A Megatron-LM
    checkpoint directory is read as ``pretrain_gpt.py --load`` reads it (``checkpoint/megatron_load.py``): the
    architecture from its saved arguments, ``vocab_size`` (the tokenizer's; default: what the arguments say)
    rows of its padded vocabulary."""
    if megatron_dir(path) is not None:
        from .checkpoint.megatron_load import open_checked, read_full
        opened = open_checked(path, vocab_size)
        return opened.cfg, read_full(opened)
    ckpt = resolve_checkpoint_dir(path)
    info = read_info(ckpt)
    saved = info.get("model_config")
    if not saved:
        raise CheckpointError(f"{ckpt} records no model configuration: the architecture cannot be told")
    # the architecture; the saved run's kernel choices (--attention-backend fused on a GPU, ...) are not this run's
    known = {f.name for f in dataclasses.fields(ModelConfig)} - set(KERNEL_FIELDS)
    cfg = ModelConfig(**{k: v for k, v in saved.items() if k in known})
    return cfg, read_full_model(ckpt, info)


def load_for_generation(path: str, device: str | torch.device = "cpu",
                        vocab_size: int | None = None) -> tuple[GPTModel, ModelConfig]:
    """A single-process GPT (eval mode, dropout off) holding a checkpoint's weights (a megareshard checkpoint, or a
    Megatron-LM directory with ``vocab_size`` rows of its vocabulary: ``read_model_weights``)."""
    cfg, weights = read_model_weights(path, vocab_size)
    cfg = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, ParallelContext.single_process(), seed=0, device=torch.device(device))
    missing = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = weights.get(name)
            if w is None:
                missing.append(name)
                continue
            if tuple(w.shape) == tuple(p.shape):
                p.copy_(w)
            elif w.dim() == p.dim() and w.shape[1:] == p.shape[1:] and w.shape[0] <= p.shape[0]:
                p.zero_()
                p[: w.shape[0]].copy_(w)  # the vocabulary padding rows of this process's layout stay zero
            else:
                raise CheckpointError(f"{path}: {name} is {tuple(w.shape)} in the checkpoint but "
                                      f"{tuple(p.shape)} in a model built from its configuration")
    if missing:
        raise CheckpointError(f"{path}: the checkpoint has no weights for {missing[:5]}"
                              f"{' …' if len(missing) > 5 else ''}")
    route_dropless(model)   # MoE: no capacity at inference (Megatron-Core's inference router drops no token)
    return model.eval(), cfg


@torch.no_grad()
def generate_ids(model: GPTModel, cfg: ModelConfig, prompt: list[int], *, max_new_tokens: int,
                 top_p: float | None = None, temperature: float = 1.0, seed: int = 0,
                 eod: int | None = None) -> list[int]:
    """Extend `prompt` by up to `max_new_tokens`: greedy (`top_p` None) or nucleus sampling."""
    if not prompt:
        raise ValueError("the prompt encodes to no tokens: give some text")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if temperature <= 0:
        raise ValueError(f"--temperature must be positive, got {temperature}")
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ctx = torch.tensor([ids[-cfg.seq_length:]], dtype=torch.long, device=device)
        logits = model(tokens=ctx)[0, -1, :cfg.vocab_size].float().cpu()  # drop the padding columns
        if top_p is None:
            nxt = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p  # smallest prefix whose mass reaches top_p
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            nxt = int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
        ids.append(nxt)
        if eod is not None and nxt == eod:
            break
    return ids
