"""Generator replicas in the same job (issue #50, megareshard/generators.py): one launch of 5 gloo ranks in NCCL's
checking mode — a trainer at pp 2 on ranks 0-1, generator replicas tp 2 (ranks 2-3) and tp 1 (rank 4). After
every transfer each replica's weights equal bitwise what the checkpoint of that step holds, cut to the replica's
layout (its tp slice, vocabulary padding zero), and its greedy continuation with a key/value cache equals the
single-process, no-cache `generation.generate_ids` on that checkpoint (past the model's window too). Bad input is
one line at start-up, before any process group."""
from __future__ import annotations

import io
import os

import pytest
import torch

from megareshard.arguments import parse_args
from megareshard.config_fields import ConfigError
from tests.harness import run_ranks

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--position-embedding-type", "rope", "--seq-length", "16",
         "--mock-data", "--vocab-size", "100", "--make-vocab-size-divisible-by", "8", "--init-method-std", "0.3",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-2", "--device", "cpu",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "0"]
PROMPTS = [[1, 2, 3], [40, 41]]
NEW = 18  # 3 + 18 > 16: the window slides, the cache is rebuilt


def _rank(rank: int, world: int, argv: list[str]):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from megareshard import generators
    from megareshard.model_spec import get_model_spec
    from megareshard.training import pretrain

    seen = []

    def observe(ev):
        params = {n: (p.detach().clone(), getattr(p, "expert_box", None) or (int(getattr(p, "partition_dim", -1))
                      if getattr(p, "tensor_model_parallel", False) else -1))
                  for n, p in ev["model"].named_parameters()}
        seen.append({k: ev[k] for k in ("step", "replica", "tp", "tp_rank", "samples")} | {"params": params})

    generators.transfer_observers[:] = [observe]
    out = io.StringIO()
    records = pretrain(parse_args(argv, world_size=world), out=out, model_spec=get_model_spec("gpt"),
                       launch_split=generators.pretrain_with_generators)
    return records, seen, out.getvalue()


def _expected(full: torch.Tensor, shape, dim, tp: int, tp_rank: int) -> torch.Tensor:
    """A full checkpoint tensor cut as a load into tp ``tp`` does: padded rows zero, this rank's slice; an expert
    tensor (``dim`` its ``expert_box``: global shape and offset) the box this rank holds."""
    if isinstance(dim, tuple):
        gshape, goff = dim
        assert tuple(full.shape) == tuple(gshape), (full.shape, gshape)
        return full[tuple(slice(o, o + n) for o, n in zip(goff, shape))]
    if dim < 0:
        return full
    rows = shape[0] * (tp if dim == 0 else 1)
    if full.shape[0] < rows:   # the vocabulary padding of this layout
        full = torch.cat((full, full.new_zeros(rows - full.shape[0], *full.shape[1:])))
    return full.chunk(tp, dim=dim)[tp_rank]


@pytest.mark.slow
def test_generators_receive_every_transfer_exactly_and_sample_like_generate(tmp_path):
    from megareshard.generation import generate_ids, load_for_generation, read_model_weights

    root = str(tmp_path / "ckpt")
    argv = MODEL + ["--pipeline-model-parallel-size", "2", "--train-iters", "3", "--save", root,
                    "--save-interval", "1", "--generator-layouts", "tp2,tp1", "--transfer-interval", "2",
                    "--transfer-bucket-mb", "0.01", "--generator-max-new-tokens", str(NEW),
                    "--generator-prompts", "|".join(" ".join(map(str, p)) for p in PROMPTS),
                    "--metrics-file", str(tmp_path / "metrics.jsonl")]
    res = run_ranks(_rank, 5, argv, nccl_check=True, timeout=240)
    trainer, gens = res[:2], res[2:]
    # the trainer: transfers after iterations 2 (the interval) and 3 (the last), reported on the log line
    recs = trainer[1][0]
    assert [r["iteration"] for r in recs if "transfer_bytes" in r] == [2, 3]
    assert all(r["transfer_bytes"] > 0 and r["transfer_s"] > 0 for r in recs if "transfer_bytes" in r)
    assert "weight transfer:" in trainer[1][2] and "megareshard: weight transfer to generator tp2" in trainer[0][2]
    assert sum(1 for line in open(tmp_path / "metrics.jsonl") if "transfer_bytes" in line) == 2
    # the generators: printed their samples, tagged with the step
    assert "generator tp2 (step 2): '1 2 3' -> " in gens[0][2] and "generator tp1 (step 3): '40 41'" in gens[2][2]
    assert gens[1][2] == ""  # tp rank 1 prints nothing
    checked = 0
    for _, seen, _ in gens:
        assert [ev["step"] for ev in seen] == [2, 3]
        for ev in seen:
            ckpt = f"{root}/iter_{ev['step']:07d}"
            _, weights = read_model_weights(ckpt)
            for name, (t, dim) in ev["params"].items():
                want = _expected(weights[name], t.shape, dim, ev["tp"], ev["tp_rank"])
                assert torch.equal(t, want), (ev["step"], ev["replica"], name)
                checked += 1
            model, cfg = load_for_generation(ckpt)
            for ids, full in ev["samples"]:
                assert full == generate_ids(model, cfg, ids, max_new_tokens=NEW), (ev["step"], ids)
    assert checked > 0
    # the two replicas, the two steps: the same continuations (the same weights)
    assert gens[0][1][1]["samples"] == gens[2][1][1]["samples"]


@pytest.mark.parametrize("extra, world, says", [
    (["--generator-layouts", "tp3"], 4, "tensor-parallel size 3 does not divide --num-attention-heads 4"),
    (["--generator-layouts", "tp4"], 5, "does not divide --num-attention-heads 4 and the 2 key/value head(s)"),
    (["--generator-layouts", "tp2,tp1", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
      "2"], 6, "takes the last 3 of the 6 ranks, leaving 3 to the trainer, which needs a multiple of tp 2 × pp 2 = "
               "4: launch 7 ranks"),
    (["--generator-layouts", "tp2", "--pipeline-model-parallel-size", "2"], 3, "leaving 1 to the trainer"),
    (["--generator-layouts", "2x"], 3, "entry '2x' is not tpN"),
    (["--generator-layouts", "tp1", "--transfer-interval", "0"], 2, "--transfer-interval must be at least 1"),
    (["--generator-layouts", "tp2", "--num-experts", "4"], 3, "generator replica 0 (tp2): expert biases with "
                                                               "expert-tensor-parallel size 2 are not supported"),
    (["--generator-layouts", "tp2ep2"], 3, "generator replica 0 (tp2ep2) sets an expert layout, which needs "
                                           "--num-experts"),
    (["--generator-layouts", "tp1,tp2ep2etp2"], 4, "entry 'tp2ep2etp2': expert-parallel size 2 × "
                                                   "expert-tensor-parallel size 2 does not divide its tensor-parallel "
                                                   "size 2"),
    (["--generator-layouts", "tp2", "--num-experts", "4", "--moe-ffn-hidden-size", "4", "--disable-bias-linear",
      "--moe-grouped-gemm"], 3, "generator replica 0 (tp2): --moe-grouped-gemm needs rows of a multiple of 16 bytes "
                                "(torch._grouped_mm): a rank's expert width 2 not a multiple of 4"),
    (["--generator-layouts", "tp2ep2", "--num-experts", "3"], 3,
     "generator replica 0 (tp2ep2): num_experts 3 is not divisible by expert-model-parallel-size 2"),
])
def test_bad_generator_flags_are_one_line(extra, world, says):
    with pytest.raises(ConfigError) as e:
        parse_args(MODEL + ["--train-iters", "2"] + extra, world_size=world)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_expert_layouts_of_a_replica():
    """``tpN[epM][etpK]``: the experts split inside the replica's tp ranks, etp tp / ep unless given (etp 1 keeps
    expert biases, which etp > 1 refuses)."""
    from megareshard.config.generators import ReplicaLayout, parse_generator_layouts

    got = parse_generator_layouts("tp2,TP4EP2,tp4ep2etp1,2,tp2etp1")
    assert got == [ReplicaLayout(2), ReplicaLayout(4, 2), ReplicaLayout(4, 2, 1), ReplicaLayout(2), ReplicaLayout(2, 1, 1)]
    assert [g.expert_tp for g in got] == [2, 2, 1, 2, 1] and got[2].label == "tp4ep2etp1"
    parse_args(MODEL + ["--train-iters", "2", "--num-experts", "4", "--generator-layouts", "tp2etp1"], world_size=3)


def test_prompts_must_fit_the_model():
    from megareshard.generators import read_prompts

    cfg = parse_args(MODEL + ["--train-iters", "2", "--generator-layouts", "tp1", "--generator-prompts", "1 2|500"],
                     world_size=2)
    with pytest.raises(ConfigError, match="outside the model's vocabulary of 100"):
        read_prompts(cfg, None)
    cfg = parse_args(MODEL + ["--train-iters", "2", "--generator-layouts", "tp1", "--generator-prompts", "hello"],
                     world_size=2)
    with pytest.raises(ConfigError, match="without a tokenizer"):
        read_prompts(cfg, None)


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "0.01",
       "--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "1.0", "--disable-bias-linear"]


@pytest.mark.slow
def test_moe_generators_and_generate_tool_read_any_expert_layout(tmp_path, capsys):
    """MoE (issue #52): a trainer at tp 2 · ep 2 (etp 1, sequence parallel, capacity factor 1: tokens dropped in
    training) pushes to a tp 2 replica (ep 1, etp 2: every expert's half width on each rank; no sequence
    parallelism, which generation does not need), to a tp 2 · ep 2 one (`tp2ep2`: etp 1, two whole experts on
    each rank, tokens dispatched between them) and to a `tp2etp1` one (every expert whole on both ranks: its two
    expert-data-parallel copies). Their weights equal bitwise the checkpoint of that step cut to each
    layout, and greedy-with-cache through the MoE layers equals `generate_ids` on it; both route dropless (the
    capacity is a training device: Megatron-Core's inference router drops no token). (A replica holding all experts
    whole is tests/resharding/test_weight_transfer.py's tp 1 destination.) `tools/generate.py` on the tp 2 · ep 2
    checkpoint and on the same weights saved by one process at ep 1 prints the same ids, bitwise: it reads every
    expert tensor whole from its boxes, whatever ep/etp/tp wrote them, so both build the same single-process model
    from the same bits and run the same arithmetic — no tolerance is needed (and the ids equal the replica's)."""
    from megareshard.cli import generate as tool
    from megareshard.generation import generate_ids, load_for_generation, read_model_weights
    from megareshard.checkpoint.manager import CheckpointManager
    from megareshard.parallel import ParallelContext

    root, single = str(tmp_path / "ckpt"), str(tmp_path / "ep1")
    train = MODEL + MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size",
                           "2", "--expert-tensor-parallel-size", "1", "--train-iters", "1"]
    new = 6
    argv = train + ["--save", root, "--save-interval", "1", "--generator-layouts", "tp2,tp2ep2,tp2etp1",
                    "--generator-max-new-tokens", str(new), "--generator-prompts", " ".join(map(str, PROMPTS[0]))]
    res = run_ranks(_rank, 8, argv, nccl_check=True, timeout=240)
    assert "generator tp2 (step 1): '1 2 3' -> " in res[2][2] and "generator tp2ep2 (step 1): '1 2 3' -> " in res[4][2]
    assert "generator tp2etp1 (step 1): '1 2 3' -> " in res[6][2]
    ckpt = f"{root}/iter_0000001"
    _, weights = read_model_weights(ckpt)
    model, cfg = load_for_generation(ckpt)
    boxes = set()
    for _, seen, _ in res[2:]:
        (ev,) = seen
        assert ev["step"] == 1 and any(".experts." in n for n in ev["params"])
        for name, (t, dim) in ev["params"].items():
            assert torch.equal(t, _expected(weights[name], t.shape, dim, ev["tp"], ev["tp_rank"])), name
            boxes.add((ev["replica"], name, str(dim)))
        ((ids, full),) = ev["samples"]
        assert full == generate_ids(model, cfg, ids, max_new_tokens=new), ev["replica"]
    # the two replicas hold the experts otherwise: ep 1 · etp 2 (width halves) and ep 2 · etp 1 (whole experts)
    fc2 = "layers.0.mlp.experts.fc2.weight"
    assert {d for r, n, d in boxes if n == fc2 and r == 0} == {"((4, 32, 16), (0, 0, 0))", "((4, 32, 16), (0, 0, 8))"}
    assert {d for r, n, d in boxes if n == fc2 and r == 1} == {"((4, 32, 16), (0, 0, 0))", "((4, 32, 16), (2, 0, 0))"}
    assert {d for r, n, d in boxes if n == fc2 and r == 2} == {"((4, 32, 16), (0, 0, 0))"}   # whole, on both ranks
    # the same weights saved at ep 1 by one process (the tp 2 · ep 2 checkpoint read whole, saved again)
    CheckpointManager(ParallelContext.single_process(), out=None).save(single, 1, model=model)
    printed = []
    for load in (root, single):
        assert tool.main(["--load", load, "--prompt", "1 2 3", "--max-new-tokens", str(new), "--ids",
                          "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]) == 0
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and printed[0].splitlines()[-1] == str(full), printed
