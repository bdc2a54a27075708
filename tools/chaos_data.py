"""Tiny real Trainers with a fault injected into one rank's iteration (shared by the reliability tests and
tools/chaos.py): the forward/backward function is wrapped after the Trainer is built, so the pipeline
runtime (pp > 1) keeps running underneath."""
from __future__ import annotations

import contextlib
import io
import math
import os
import shutil
import subprocess
import tempfile

import torch

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "100",
        "--eval-interval", "0", "--device", "cpu"]


class Inject:
    """Wraps a Trainer's forward/backward: at ``iteration`` (1-based) on ``rank``, poison the loss and/or
    the gradient of parameter ``param`` (with ``value``: nan or inf) after the backward."""

    def __init__(self, trainer, *, iteration: int, rank: int, loss: bool = False, param: str | None = None,
                 value: float = math.nan) -> None:
        self.trainer, self.inner = trainer, trainer.forward_backward_fn
        self.finalizes_grads = getattr(self.inner, "finalizes_grads", False)
        self.iteration, self.rank, self.loss, self.param, self.value = iteration, rank, loss, param, value

    def __call__(self, model, microbatches, device, **kw):
        out = self.inner(model, microbatches, device, **kw)
        hit = self.trainer.iteration + 1 == self.iteration and self.trainer.ctx.rank == self.rank
        if hit and kw.get("backward", True):
            if self.param is not None:
                p = dict(model.named_parameters())[self.param]
                with torch.no_grad():
                    p.grad.view(-1)[0] = self.value
            if self.loss:
                out = out + self.value
        return out


def build_trainer(argv: list[str], world_size: int):
    """A Trainer on this process's rank of ``world_size`` (torch.distributed initialised when > 1)."""
    from megareshard.arguments import parse_args
    from megareshard.training import Trainer, build_context

    cfg = parse_args(TINY + argv, world_size=world_size)
    ctx, _ = build_context(cfg, world_size)
    return Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())


def params_snapshot(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@contextlib.contextmanager
def tmpfs(kib: int):
    """A fresh tmpfs of ``kib`` KiB mounted on a temp dir (unmounted and removed on exit). Needs root and
    a kernel that lets this process mount; otherwise pytest skips (in tests) with the precise reason."""
    reason = None
    if os.geteuid() != 0:
        reason = "a tmpfs for the disk-full fault needs root (mount -t tmpfs)"
    mnt = tempfile.mkdtemp(prefix="mr-tmpfs-")
    if reason is None:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", mnt], capture_output=True,
                           text=True)
        if r.returncode:
            reason = f"mount -t tmpfs failed: {r.stderr.strip() or r.returncode}"
    if reason is not None:
        os.rmdir(mnt)
        raise NoTmpfs(reason)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], check=False)
        os.rmdir(mnt)


class NoTmpfs(RuntimeError):
    """No tmpfs could be mounted here (not root, or mounting is not allowed)."""


def fill_disk(path: str, leave: int = 4096) -> None:
    """Fill the file system of ``path`` with a file ``filler`` until fewer than ``leave`` bytes are free."""
    free = shutil.disk_usage(path).free
    with open(os.path.join(path, "filler"), "wb") as f:
        try:
            f.write(b"\0" * max(free - leave, 0))
            f.flush()
            os.fsync(f.fileno())
        except OSError:
            pass
