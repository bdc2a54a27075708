"""Peer check: our ZeRO-2 matches DeepSpeed's ZeRO-2 on a dp-only run (dp 2, 5 steps, within 1e-5).

DeepSpeed pitfalls (measured with deepspeed 0.19 on CPU): its default ``gradient_clipping`` is 1.0 — set here
explicitly to the same value as ours; ``"type": "AdamW"`` with ``"torch_adam": true`` makes
it use ``torch.optim.AdamW`` (no JIT-compiled FusedAdam/CPUAdam), the same math as ours;
the decay / no-decay parameter groups are passed to both. On CPU, DeepSpeed's comm
backend JIT-compiles a shared-memory all-reduce op on first use (≈90 s on 2 busy cores);
it is only a faster transport for the same collectives, so it is switched off here
(``build_shm_op`` → None: DeepSpeed then uses torch.distributed/gloo, as we do) and
``TORCH_EXTENSIONS_DIR`` points at a temporary directory in case anything else compiles.
DeepSpeed also wants ``LOCAL_RANK`` (set by its launcher or torchrun): set here.
"""
import os
import tempfile

import pytest
import torch

from megareshard.models import GPTModel
from megareshard.optim.zero import ZeroOptimizer
from megareshard.parallel import ParallelContext, Topology
from tests.harness import run_ranks
from tests.test_zero import BETAS, EPS, MB, WD, _params_close, batches, tiny_cfg

pytest.importorskip("deepspeed", reason="deepspeed extra not installed (tools/ensure_venv.sh installs it)")

STEPS, LR, CLIP = 5, 1e-2, 1.0


class _LossModule(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous()).float().mean()


def ds_config(stage):
    return {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                     "weight_decay": WD, "torch_adam": True}},
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096, "allgather_bucket_size": 4096,
                                  "overlap_comm": False, "contiguous_gradients": True},
            "fp16": {"enabled": False}, "bf16": {"enabled": False},
            "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


def param_groups(module):
    decay = [p for _, p in module.named_parameters() if p.ndim >= 2]
    no_decay = [p for _, p in module.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def run_deepspeed(ctx, stage, steps):
    import sys

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (``deepspeed.comm.torch`` as an attribute is torch itself)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None   # no JIT-compiled shm op (module doc)

    module = _LossModule(GPTModel(tiny_cfg(), ctx, seed=3))
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=param_groups(module),
                                           config=ds_config(stage), dist_init_required=False)
    losses = []
    for mbs in batches(ctx.dp_rank(), steps):
        loss = engine(mbs[0])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine, module


def run_ours(ctx, stage, steps):
    model = GPTModel(tiny_cfg(), ctx, seed=3)
    module = _LossModule(model)
    opt = ZeroOptimizer(model.named_parameters(), ctx, stage=stage, lr=LR, weight_decay=WD, betas=BETAS, eps=EPS,
                        bucket_bytes=4096)
    losses = []
    for mbs in batches(ctx.dp_rank(), steps):
        opt.zero_grad()
        loss = module(mbs[0])
        loss.backward()
        opt.finish_grad_sync()
        opt.clip_grad_norm(CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, opt, module


def _peer(rank, world_size, ext_dir):
    os.environ.update(TORCH_EXTENSIONS_DIR=ext_dir, LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    ctx = ParallelContext.create(Topology(world_size))
    ds_losses, _, ds_module = run_deepspeed(ctx, 2, STEPS)
    our_losses, _, our_module = run_ours(ctx, 2, STEPS)
    ds_params = {n: p.detach().float().clone() for n, p in ds_module.named_parameters()}
    our_params = {n: p.detach().clone() for n, p in our_module.named_parameters()}
    return ds_losses, our_losses, ds_params, our_params


@pytest.mark.slow
def test_zero2_matches_deepspeed_zero2():
    with tempfile.TemporaryDirectory(prefix="mr-ds-ext-") as ext:
        results = run_ranks(_peer, 2, ext, timeout=300)
    for ds_losses, our_losses, ds_params, our_params in results:
        torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(ds_losses), rtol=1e-5, atol=0)
        # norm-wise per tensor within the error bound of STEPS Adam updates (tests/tolerances.py); the key
        # part of the QKV bias has a pure-noise gradient (see test_zero)
        _params_close(our_params, ds_params, "ours vs DeepSpeed ZeRO-2", STEPS, tiny_cfg().num_attention_heads)
