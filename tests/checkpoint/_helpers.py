"""Shared pieces of the checkpoint tests: a tiny GPT trained by hand (model, ZeRO, schedule, sampler)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megareshard.arguments import ModelConfig
from megareshard.data.mock import MockGPTDataset
from megareshard.data.sampler import GlobalBatchSampler, collate
from megareshard.models.gpt import GPTModel
from megareshard.optim import LRScheduler, WarmupCosine
from megareshard.optim.zero import ZeroOptimizer
from megareshard.parallel import ParallelContext, Topology
from megareshard.tensor_parallel import sync_sequence_parallel_grads

GB, MB, VOCAB, SEQ = 16, 2, 100, 16


def no_saves_after(trainer, iteration: int):
    """``trainer`` saving no checkpoint after ``iteration``: the end-of-training save Megatron-LM makes, which the
    relayout tests never read (seconds of an 8-rank launch on 2 cores). Returns the trainer."""
    from megareshard.training import Trainer

    trainer.save_checkpoint = lambda: None if trainer.iteration > iteration else Trainer.save_checkpoint(trainer)
    return trainer


def model_config(dropout: float = 0.0, **kw) -> ModelConfig:
    args = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
                hidden_dropout=dropout, attention_dropout=dropout)
    args.update(kw)
    return ModelConfig(**args)


class Run:
    """Model + ZeroOptimizer + LR schedule + sampler for one layout, trained like the Trainer does."""

    def __init__(self, ctx: ParallelContext, zero: int, *, dropout: float = 0.0, seed: int = 1234,
                 cfg: ModelConfig | None = None) -> None:
        self.ctx = ctx
        self.cfg = cfg or model_config(dropout)
        torch.manual_seed(seed)
        self.model = GPTModel(self.cfg, ctx, seed=seed)
        self.model.train()
        self.opt = ZeroOptimizer(self.model.named_parameters(), ctx, stage=zero, lr=1e-3, weight_decay=0.1,
                                 betas=(0.9, 0.95))
        self.sched = LRScheduler(self.opt, WarmupCosine(1e-3, 1e-4, 2, 20))
        self.data = MockGPTDataset(VOCAB, SEQ, 20 * GB, seed=7)
        self.sampler = GlobalBatchSampler(len(self.data), GB, MB, ctx.dp_size, ctx.dp_rank(), order="megatron")
        self._it = None
        self.iteration = 0

    def step(self) -> float:
        if self._it is None:
            self._it = iter(self.sampler)
        indices = next(self._it)
        self.sched.step()
        self.opt.zero_grad()
        total = torch.zeros(())
        n = len(indices)
        for mb in indices:
            tokens = collate([self.data[i] for i in mb])["tokens"]
            loss = self.model(tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous()).float().mean() / n
            loss.backward()
            total += loss.detach()
        if self.model.sequence_parallel:
            sync_sequence_parallel_grads(self.model, self.ctx)
        self.opt.finish_grad_sync()
        self.opt.clip_grad_norm(1.0)
        self.opt.step()
        if self.ctx.dp_size > 1:
            dist.all_reduce(total, group=self.ctx.dp_group)
            total /= self.ctx.dp_size
        self.iteration += 1
        return total.item()

    def train(self, n: int) -> list[float]:
        return [self.step() for _ in range(n)]

    def objects(self) -> dict:
        return dict(model=self.model, optimizer=self.opt, scheduler=self.sched, sampler=self.sampler)


def make_ctx(world: int, tp: int, pp: int = 1) -> ParallelContext:
    if world == 1:
        return ParallelContext.single_process()
    return ParallelContext.create(Topology(world, tp=tp, pp=pp, nproc_per_node=world))




def load_tool():
    """tools/checkpoint_util.py as a module."""
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "tools", "checkpoint_util.py")
    spec = importlib.util.spec_from_file_location("checkpoint_util", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
