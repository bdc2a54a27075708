"""Expert parallelism on gloo ranks in NCCL's checking mode: dropless MoE layers at ep 2 and ep 4 (alltoall and
allgather dispatchers), ep 2 × tp 2 (etp 2, sequence parallel, shared experts) and ep 2 × etp 1 beside tp 2,
reproduce the single-process layer's outputs, input and weight gradients and load-balancing/z losses. One
launch of 4 ranks runs every case (a fresh ParallelContext each)."""
from __future__ import annotations

import torch

from megareshard.models.config import ModelConfig
from megareshard.models.gpt import _normal_init
from megareshard.parallel.expert_topology import expert_groups
from megareshard.parallel.topology import Topology
from tests.harness import run_ranks
from tests.tolerances import U

S, B, H, F, E, K = 8, 4, 16, 24, 4, 2      # sequence, global batch, hidden, expert width, experts, top-k
# (tp, ep, etp, dispatcher); dp = 4 / tp, edp = 4 / (ep · etp)
CASES = [(1, 2, 1, "alltoall"), (1, 2, 1, "allgather"), (1, 4, 1, "alltoall"), (1, 4, 1, "allgather"),
         (2, 2, 2, "alltoall"), (2, 2, 2, "allgather"), (2, 2, 1, "alltoall")]


def _cfg(tp: int, dispatcher: str) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, seq_length=S,
                       vocab_size=64, swiglu=True, disable_bias_linear=True, num_experts=E, moe_router_topk=K,
                       moe_ffn_hidden_size=F, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                       moe_token_dispatcher_type=dispatcher,
                       moe_shared_expert_intermediate_size=16 if tp > 1 else None)


def _data():
    g = torch.Generator().manual_seed(11)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _build(cfg, ctx, sp: bool):
    from megareshard.models.moe import MoELayer

    return MoELayer(cfg, ctx, "layers.0.mlp", lambda name, std: _normal_init(5, name, std), 0.01,
                    sequence_parallel=sp)


def _rank(rank: int, world: int):
    import torch.distributed as dist

    from megareshard.models.moe import gather_full_expert_tensor, moe_losses, reduce_expert_grads
    from megareshard.parallel import ParallelContext
    from megareshard.tensor_parallel import gather_full_tensor, sync_sequence_parallel_grads

    x_full, g_full = _data()
    results = []
    for tp, ep, etp, dispatcher in CASES:
        ctx = ParallelContext.create(Topology(world_size=world, tp=tp), expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=etp)
        layer = _build(_cfg(tp, dispatcher), ctx, tp > 1)
        b = B // ctx.dp_size
        rows, cols = slice(ctx.tp_rank() * S // tp, (ctx.tp_rank() + 1) * S // tp), slice(ctx.dp_rank() * b,
                                                                                         (ctx.dp_rank() + 1) * b)
        x = x_full[rows, cols].clone().requires_grad_(True)
        out = layer(x)
        (out * g_full[rows, cols]).sum().backward()
        sync_sequence_parallel_grads(layer, ctx)                    # the router (and norms): over tp
        reduce_expert_grads(layer, ctx, scale=1.0)                  # experts: summed over edp only
        grads = {}
        for name, p in layer.named_parameters():
            if getattr(p, "expert_parallel", False):
                grads[name] = gather_full_expert_tensor(p.grad, p, ctx)
            else:                                                   # dense: summed over dp, then the tp shards
                gr = p.grad.clone()
                dist.all_reduce(gr, group=ctx.dp_group)
                grads[name] = gather_full_tensor(gr, p, ctx)
        losses = {k: v.clone() for k, v in moe_losses(layer, ctx).items()}
        results.append(dict(out=out.detach(), xgrad=x.grad, rows=rows, cols=cols, grads=grads, losses=losses,
                            ep_rank=ctx.ep_rank(), local=layer.experts.local_expert_indices))
        dist.barrier()
        ctx.destroy()
    return results


def test_expert_groups_follow_megatron_order():
    """tp 2 × dp 4 with ep 2, etp 2: the expert-tensor group is the tp group, ep runs along consecutive dp ranks,
    edp holds the replicas; etp 1 takes tp and dp ranks together (Megatron-Core's tp-ep-dp generator)."""
    g = expert_groups(Topology(world_size=8, tp=2), ep=2, etp=2)
    assert g["etp"] == [(0, 1), (2, 3), (4, 5), (6, 7)] and g["ep"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert g["edp"] == [(0, 4), (1, 5), (2, 6), (3, 7)] and g["etp_ep"] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    g = expert_groups(Topology(world_size=8, tp=2), ep=4, etp=1)
    assert g["ep"] == [(0, 1, 2, 3), (4, 5, 6, 7)] and g["etp"] == [(r,) for r in range(8)]


def test_expert_parallel_layers_equal_single_process():
    from megareshard.models.moe import moe_losses
    from megareshard.parallel import ParallelContext

    per_rank = run_ranks(_rank, 4, nccl_check=True, timeout=240)
    x_full, g_full = _data()
    single = ParallelContext.single_process()
    for c, (tp, ep, etp, dispatcher) in enumerate(CASES):
        dp = 4 // tp
        ref = _build(_cfg(tp, dispatcher), single, False)
        b = B // dp
        outs, xgrads, losses = [], [], []
        x_ref = x_full.clone().requires_grad_(True)
        for d in range(dp):           # each dp replica's micro-batch routed (and its losses taken) on its own
            out = ref(x_ref[:, d * b:(d + 1) * b])
            (out * g_full[:, d * b:(d + 1) * b]).sum().backward()
            outs.append(out.detach())
            losses.append(moe_losses(ref, single))
        out_ref = torch.cat(outs, dim=1)
        # forward: sums of h (router, fc1), F (fc2), the shared experts' h + 16, k experts and etp partial sums;
        # backward: the weight gradients add up every token's product (S·B) on top
        fwd = 2 * H + F + K + etp + (H + 16 if tp > 1 else 0)
        bwd = fwd + S * B
        label = f"tp {tp} ep {ep} etp {etp} {dispatcher}"
        for r, res in enumerate(per_rank):
            got = res[c]
            for what, mine, full, n in (("output", got["out"], out_ref, fwd), ("input grad", got["xgrad"], x_ref.grad, bwd)):
                want = full[got["rows"], got["cols"]]
                tol = 4 * n * U * want.abs().max().item()
                assert (mine - want).abs().max().item() <= tol, (label, r, what)
            d = got["cols"].start // b
            for name, v in got["losses"].items():
                assert abs(v.item() - losses[d][name].item()) <= 4 * (S * B + H) * U * abs(losses[d][name].item()), (label, r, name)
            assert got["local"] == list(range(got["ep_rank"] * E // ep, (got["ep_rank"] + 1) * E // ep))
            for name, p in ref.named_parameters():
                tol = 4 * bwd * U * p.grad.abs().max().item()
                assert (got["grads"][name] - p.grad).abs().max().item() <= tol, (label, r, name)
