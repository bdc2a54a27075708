"""Megatron-LM checkpoints in and out, against Megatron-Core itself (tests/checkpoint/megatron_oracle.py).

Megatron-Core (the ``megatron-core`` package, installed by tools/ensure_venv.sh) builds, runs and saves tiny
Llama-style and GPT-style models at tensor parallelism 1 and 2 (``torch_dist``), and per-rank ``torch``
files (the Llama at tp 2, the GPT at pipeline parallelism 2), once per session. Here:

* ``import-megatron`` of each prints flags that parse into the architecture of its saved arguments, and
  the imported checkpoint (``--load OUT --finetune``) and the Megatron-LM directory itself (``--load DIR``)
  give Megatron-Core's logits on the same tokens (fp32, tolerance from the arithmetic: tests/tolerances.py),
  the two bit for bit alike (same weights, same code);
* the Megatron-LM directories load straight into tp 2 · pp 2 with virtual stages and the distributed
  optimizer, and into dp 2 · pp 2 (4 gloo ranks, NCCL's rules checked), with the same logits;
* ``export-megatron`` of each imported ``torch_dist`` checkpoint, loaded by Megatron-Core's
  ``dist_checkpointing.load`` into a freshly built model of the same configuration and tp, gives back the
  original weights bit for bit (real vocabulary rows) and Megatron-Core's logits bit for bit.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import sys

import pytest
import torch
import torch.distributed as dist

from megareshard.arguments import parse_args
from megareshard.checkpoint.megatron import model_config_from_args
from megareshard.checkpoint.megatron_io import MegatronCheckpoint
from megareshard.models import hf as hf_map
from megareshard.parallel import ParallelContext
from megareshard.tensor_parallel import all_gather_dim
from megareshard.training import Trainer, build_context
from tests.harness import run_ranks
from tests.tolerances import forward_tolerance, gpt_forward_reductions

from . import megatron_oracle as oracle
from ._helpers import load_tool

FIXTURES = ["llama_tp1", "llama_tp2", "gpt_tp1", "gpt_tp2", "llama_tp2_torch", "gpt_pp2_torch"]


def _require_megatron_core() -> None:
    """megatron-core installs from its Linux wheels (tools/ensure_venv.sh); elsewhere the oracle cannot run."""
    if importlib.util.find_spec("megatron") is not None:
        try:
            importlib.metadata.version("megatron-core")
            return
        except importlib.metadata.PackageNotFoundError:
            pass
    if sys.platform.startswith("linux"):
        raise AssertionError("megatron-core is not installed: tools/ensure_venv.sh installs it (the 'megatron' extra)")
    pytest.skip(f"megatron-core ships Linux wheels only; this is {sys.platform}")


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """(work dir, oracle result): every Megatron-Core checkpoint and reference, made once."""
    _require_megatron_core()
    work = tmp_path_factory.mktemp("megatron")
    return work, oracle.run_oracle(str(work))


def _tolerance(arch: str, ref: torch.Tensor) -> float:
    a = oracle.ARCHS[arch]
    n = gpt_forward_reductions(a["num_layers"], a["hidden_size"], a["ffn_hidden_size"], a["num_attention_heads"],
                               a["hidden_size"] // a["num_attention_heads"], oracle.SEQ)
    return forward_tolerance(n, ref.abs().max().item())


def _argv(load: str, flags: list[str]) -> list[str]:
    return ["--mock-data", "--seq-length", str(oracle.SEQ), "--load", load, "--device", "cpu",
            "--micro-batch-size", "1", "--global-batch-size", "4", *flags]


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURES)
def test_import_megatron_gives_megatron_cores_logits(megatron, name, tmp_path, capsys):
    work, res = megatron
    src, out = str(work / name), str(tmp_path / "ours")
    tool = load_tool()
    assert tool.main(["import-megatron", src, out]) == 0
    printed = capsys.readouterr().out
    flags = printed.split("--finetune ", 1)[1].split()
    cfg = parse_args(_argv(out, flags + ["--finetune"]), world_size=1)
    expected, _ = model_config_from_args(MegatronCheckpoint(src).args)
    assert cfg.model.__dict__ == {**expected.__dict__, "seq_length": oracle.SEQ}    # the printed flags say it all
    ref = res["logits"][name]
    got = []
    for argv in (_argv(out, flags + ["--finetune"]), _argv(src, flags)):
        trainer = Trainer(parse_args(argv, world_size=1), ParallelContext.single_process(), torch.device("cpu"),
                          out=io.StringIO())
        with torch.no_grad():
            got.append(trainer.model.eval()(oracle.tokens())[..., :oracle.VOCAB])
        assert trainer.iteration == 0 and trainer.loaded.finetune
    err = (got[0] - ref).abs().max().item()
    assert err <= _tolerance(name.split("_")[0], ref), f"{name}: logits differ from Megatron-Core's by {err:.3g}"
    assert torch.equal(got[0], got[1])       # --load of the Megatron-LM directory: the same weights


def _pipeline_logits(trainer: Trainer, tokens: torch.Tensor) -> torch.Tensor | None:
    """Forward through every pipeline stage (virtual stages included: stage v·P + p on pp rank p), hidden
    states sent between pp ranks point to point; the full logits on the last stage's ranks, None elsewhere."""
    ctx, model = trainer.ctx, trainer.model.eval()
    P, me = ctx.pp_size, ctx.pp_rank()
    chunks = {int(s): m for s, m in model.chunks.items()} if hasattr(model, "chunks") else {me: model}
    stages = getattr(model, "num_stages", P)
    peer = {p: ctx.topology.rank_of(tp=ctx.tp_rank(), dp=ctx.dp_rank(), pp=p) for p in range(P)}
    h = trainer.cfg.model.hidden_size
    x = None
    with torch.no_grad():
        for s in range(stages):
            mesh, prev = s % P, (s - 1) % P
            if mesh != me:
                continue
            if s == 0:
                x = chunks[s](tokens)
            else:
                if prev != me:
                    x = torch.empty(tokens.shape[1], tokens.shape[0], h)
                    dist.recv(x, src=peer[prev])
                x = chunks[s](hidden=x)
            if s + 1 < stages and (s + 1) % P != me:
                dist.send(x, dst=peer[(s + 1) % P])
    if me != P - 1 or (stages - 1) % P != me:
        return None
    return all_gather_dim(x, ctx, -1)[..., :oracle.VOCAB]


def _layouts(rank: int, world: int, work: str, flags: dict[str, list[str]]) -> dict:
    """Each Megatron-LM directory loaded (--load DIR) into one layout of 4 ranks; the last stage's logits."""
    out = {}
    layouts = {"llama_tp1": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                             "--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer"],
               "gpt_tp2": ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
               "llama_tp2_torch": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]}
    for name, layout in layouts.items():
        cfg = parse_args(_argv(f"{work}/{name}", flags[name]) + layout, world_size=world)
        ctx, _ = build_context(cfg, world)
        trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
        out[name] = (ctx.tp_size, ctx.pp_size, ctx.dp_size, _pipeline_logits(trainer, oracle.tokens()))
        trainer.release_communicators()
        ctx.destroy()
    return out


@pytest.mark.slow
def test_megatron_directories_load_into_parallel_layouts(megatron):
    work, res = megatron
    flags = {}
    for name in ("llama_tp1", "gpt_tp2", "llama_tp2_torch"):
        cfg, _ = model_config_from_args(MegatronCheckpoint(str(work / name)).args)
        flags[name] = hf_map.megatron_flags(cfg)
    results = run_ranks(_layouts, 4, str(work), flags, timeout=300, nccl_check=True)
    seen = set()
    for per_rank in results:
        for name, (tp, pp, dp, logits) in per_rank.items():
            if logits is None:
                continue
            seen.add((name, tp, pp, dp))
            ref = res["logits"][name]
            err = (logits - ref).abs().max().item()
            assert err <= _tolerance(name.split("_")[0], ref), f"{name} at tp {tp} pp {pp} dp {dp}: {err:.3g}"
    assert {(n, t, p, d) for n, t, p, d in seen} == {("llama_tp1", 2, 2, 1), ("gpt_tp2", 1, 2, 2),
                                                     ("llama_tp2_torch", 2, 2, 1)}


@pytest.mark.slow
def test_export_megatron_loads_in_megatron_core_bit_for_bit(megatron):
    _, res = megatron
    assert set(res["export"]) == {"llama_tp1", "llama_tp2", "gpt_tp1", "gpt_tp2"}
    for name, check in res["export"].items():
        differ = [n for n, same in check["same_weights"].items() if not same]
        assert check["same_weights"] and not differ, f"{name}: weights differ after export: {differ}"
        assert torch.equal(check["logits"], res["logits"][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("name, planted", [("gpt_tp1", ".metadata"), ("gpt_tp1", "common.pt"),
                                           ("llama_tp2_torch", "mp_rank_01/model_optim_rng.pt")])
def test_megatron_core_checkpoints_with_a_planted_pickle_run_nothing(megatron, name, planted, tmp_path):
    """Megatron-Core's own checkpoints (``torch_dist``: its ``.metadata`` and ``common.pt``; the per-rank files)
    with one pickled file replaced by one whose ``__reduce__`` writes a marker: ``--load`` and
    ``import-megatron`` refuse it in one line naming the file and the class (the readers and the rest of the
    assertions: tests/checkpoint/test_no_code_on_load.py); the unplanted directories load as above."""
    import os
    import pickle
    import shutil

    from .test_no_code_on_load import Plant, _assert_refused, _main, _main_tool, _snapshot
    work, _ = megatron
    root = tmp_path / name
    shutil.copytree(work / name, root)
    target = next(root.glob("iter_*")) / planted
    marker = tmp_path / "marker"
    if planted == ".metadata":
        target.write_bytes(pickle.dumps(Plant(marker)))
    else:                               # the saved arguments stay readable: the plant rides beside them
        saved = torch.load(target, weights_only=False)             # Megatron-Core's own file, made by the oracle
        saved["rng_state"] = Plant(marker)
        torch.save(saved, target)
    before = _snapshot(root)
    cfg, _ = model_config_from_args(MegatronCheckpoint(str(work / name)).args)
    code, err = _main("pretrain_gpt", [*_argv(str(root), hf_map.megatron_flags(cfg)), "--train-iters", "1",
                                       "--save", str(tmp_path / "save")])
    _assert_refused(code, err, marker, str(target))
    code, err = _main_tool(load_tool(), ["import-megatron", str(root), str(tmp_path / "ours")])
    _assert_refused(code, err, marker, str(target))
    assert _snapshot(root) == before and not os.path.exists(tmp_path / "ours")
    assert not list((tmp_path / "save").glob("iter_*"))
