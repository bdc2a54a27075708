"""MoE checkpoints load into other expert layouts exactly (issue #52): a save at ep 4 (dp 4) loads at pp 2 · tp 2 ·
ep 2 (expert tensor parallelism 1, sequence parallel) on the same 4 gloo ranks (NCCL's rules checked) — every
expert, tensor-parallel and pipeline split changes at once — which saves again at once; one process loads both
saves: the same weights bit for bit, and the same next iteration bit for bit (the optimizer's moments and the
schedule came along too). Loading and saving move values, never compute them, so equality is exact."""
from __future__ import annotations

import io
import os

import torch

from megareshard.arguments import parse_args
from megareshard.parallel import ParallelContext, Topology
from megareshard.training import Trainer
from tests.test_moe_training import _argv as moe_argv
from tests.harness import run_ranks


def _ranks(rank, world, root):
    out = {}
    layouts = {"ep4": (Topology(world, tp=1), 4, None, []),
               "pp2_tp2_ep2": (Topology(world, tp=2, pp=2), 2, 1,
                               ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--pipeline-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"])}
    for name, (topo, ep, etp, extra) in layouts.items():
        ctx = ParallelContext.create(topo, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        first = name == "ep4"
        argv = moe_argv(ep=ep, iters=1, save=os.path.join(root, name),
                        load=None if first else os.path.join(root, "ep4")) + extra
        t = Trainer(parse_args(argv, world_size=world), ctx, torch.device("cpu"), out=io.StringIO())
        if first:
            t.train()              # one iteration, saved at the end
        else:
            assert t.iteration == 1
            t.save_checkpoint()    # what it loaded, saved from this layout
        t.close()
        out[name] = ctx.ep_size
        ctx.destroy()
    return out if rank == 0 else None


def test_expert_checkpoints_move_between_ep_tp_and_pp_layouts_exactly(tmp_path):
    root = str(tmp_path)
    assert run_ranks(_ranks, 4, root, timeout=300, nccl_check=True)[0] == {"ep4": 4, "pp2_tp2_ep2": 2}
    weights, nexts = {}, {}
    for name in ("ep4", "pp2_tp2_ep2"):
        t = Trainer(parse_args(moe_argv(iters=2, load=os.path.join(root, name)), world_size=1),
                    ParallelContext.single_process(), torch.device("cpu"), out=io.StringIO())
        assert t.iteration == 1
        weights[name] = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        nexts[name] = [(r["loss"], r["grad_norm"]) for r in t.train()]
        t.close()
    for name in ("pp2_tp2_ep2",):
        assert weights[name].keys() == weights["ep4"].keys()
        for n, w in weights["ep4"].items():
            assert torch.equal(weights[name][n], w), (name, n)
        assert nexts[name] == nexts["ep4"], name
