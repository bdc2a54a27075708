"""Checkpoints (single process): exact resume with dropout, atomicity under SIGKILL, validation errors,
checkpoint_util inspect/export/import, the checkpoint flags."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from megareshard.arguments import ConfigError, parse_args
from megareshard.checkpoint import KILL_ENV, CheckpointError, CheckpointManager, resolve_checkpoint_dir
from megareshard.parallel import ParallelContext

from ._helpers import Run, load_tool, model_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: intra-op threads only contend on the 2-core machines (40x slower under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _ctx():
    return ParallelContext.single_process()


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- flags -------------------------------------------------------------------------------------
BASE = ["--mock-data", "--vocab-size", "1000"]


def test_checkpoint_flags_parse():
    cfg = parse_args(BASE + ["--save", "/tmp/x", "--save-interval", "5", "--load", "/tmp/y", "--no-load-optim",
                             "--no-load-rng", "--exit-interval", "7", "--exit-signal-handler", "--async-save"],
                     world_size=1)
    ck = cfg.checkpoint
    assert (ck.save, ck.save_interval, ck.load, ck.exit_interval) == ("/tmp/x", 5, "/tmp/y", 7)
    assert ck.no_load_optim and ck.no_load_rng and ck.exit_signal_handler and ck.async_save and not ck.finetune
    assert cfg.to_dict()["checkpoint"]["save_interval"] == 5
    assert parse_args(BASE + ["--load", "/tmp/y", "--finetune"], world_size=1).checkpoint.finetune


@pytest.mark.parametrize("argv, message", [
    (["--save-interval", "5"], "--save-interval need(s) --save DIR"),
    (["--exit-signal-handler"], "--exit-signal-handler need(s) --save DIR"),
    (["--save", "d", "--save-interval", "0"], "--save-interval must be at least 1, got 0"),
    (["--save", "d", "--exit-interval", "-1"], "--exit-interval must be at least 1, got -1"),
    (["--finetune"], "--finetune only appl(y/ies) with --load DIR"),
    (["--no-load-optim", "--no-load-rng"], "--no-load-optim, --no-load-rng only appl(y/ies) with --load DIR"),
])
def test_checkpoint_flag_errors(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + argv, world_size=1)
    assert message in str(e.value)


# ---- exact resume --------------------------------------------------------------------------------
def test_exact_resume_with_dropout_is_bitwise(tmp_path):
    ref = Run(_ctx(), zero=0, dropout=0.1)
    ref_losses = ref.train(10)
    ref_params = _params(ref.model)

    a = Run(_ctx(), zero=0, dropout=0.1)
    a.train(5)
    mgr = CheckpointManager(out=None)
    mgr.save(str(tmp_path), 5, model=a.model, optimizer=a.opt, scheduler=a.sched, sampler=a.sampler,
             wandb_run_id="run-abc")
    a.train(2)                                  # the "crashed" run moves on (RNG and weights advance)

    b = Run(_ctx(), zero=0, dropout=0.1, seed=99)   # other weights and seeds: everything must come from the file
    res = mgr.load(str(tmp_path), **b.objects())
    assert (res.iteration, res.consumed_samples, res.wandb_run_id) == (5, 5 * 16, "run-abc")
    assert res.loaded_optimizer and res.loaded_rng and not res.messages
    b.model.seed = 1234
    losses = b.train(5)
    assert losses == ref_losses[5:], (losses, ref_losses[5:])   # bitwise
    for n, p in b.model.named_parameters():
        assert torch.equal(p, ref_params[n]), n


def test_finetune_and_no_load_optim(tmp_path):
    a = Run(_ctx(), zero=0)
    a.train(3)
    mgr = CheckpointManager(out=None)
    mgr.save(str(tmp_path), 3, **a.objects())
    b = Run(_ctx(), zero=0, seed=5)
    res = mgr.load(str(tmp_path), finetune=True, **b.objects())
    assert res.iteration == 0 and res.consumed_samples == 0 and not res.loaded_optimizer and not res.loaded_rng
    assert not b.opt.inner.state and b.sched.num_steps == 0 and b.sampler.consumed_samples == 0
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    c = Run(_ctx(), zero=0, seed=6)
    res = mgr.load(str(tmp_path), no_load_optim=True, **c.objects())
    assert res.iteration == 3 and not c.opt.inner.state and c.sched.num_steps == 3 and res.loaded_rng


# ---- atomicity: SIGKILL during a save -------------------------------------------------------------
_KILL_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from tests.checkpoint._helpers import Run
    from megareshard.checkpoint import CheckpointManager
    from megareshard.parallel import ParallelContext
    run = Run(ParallelContext.single_process(), zero=0)
    mgr = CheckpointManager(out=None)
    run.train(2)
    mgr.save({d!r}, 2, **run.objects())
    torch.save({{n: p.detach().clone() for n, p in run.model.named_parameters()}}, {d!r} + "/at2.pt")
    run.train(2)
    import os
    os.environ[{env!r}] = {point!r}
    mgr.save({d!r}, 4, **run.objects())       # killed inside (MEGARESHARD_CHECKPOINT_KILL_AT)
    print("survived")
""")


@pytest.mark.parametrize("point", ["before_metadata", "before_latest"])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, point):
    d = str(tmp_path / "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT.format(root=ROOT, d=d, env=KILL_ENV, point=point)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert "survived" not in proc.stdout
    with open(os.path.join(d, "latest")) as f:
        assert f.read().strip() == "iter_0000002"
    if point == "before_metadata":
        assert os.path.isdir(os.path.join(d, ".tmp.iter_0000004"))          # half-written, never renamed
        assert not os.path.exists(os.path.join(d, ".tmp.iter_0000004", ".metadata"))
    else:
        assert os.path.isdir(os.path.join(d, "iter_0000004"))             # complete but not yet `latest`
    run = Run(_ctx(), zero=0, seed=77)
    res = CheckpointManager(out=None).load(d, **run.objects())
    assert res.iteration == 2 and res.path.endswith("iter_0000002")
    saved = torch.load(os.path.join(d, "at2.pt"))
    for n, p in run.model.named_parameters():
        assert torch.equal(p, saved[n]), n


def test_resave_and_async_save(tmp_path):
    a = Run(_ctx(), zero=0)
    a.train(1)
    mgr = CheckpointManager(out=None, async_save=True)
    mgr.save(str(tmp_path), 1, **a.objects())
    snapshot = _params(a.model)
    a.train(1)                                   # trains while the thread writes (state was staged first)
    mgr.wait()
    mgr.save(str(tmp_path), 1, **a.objects())    # re-saving an iteration replaces it atomically
    mgr.close()
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "latest"]
    b = Run(_ctx(), zero=0, seed=3)
    CheckpointManager(out=None).load(str(tmp_path), **b.objects())
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert not all(torch.equal(p, snapshot[n]) for n, p in b.model.named_parameters())


# ---- validation errors ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ck") / "root")
    a = Run(_ctx(), zero=0)
    a.train(2)
    CheckpointManager(out=None).save(d, 2, **a.objects())
    return d


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return str(dst)


def _expect_error(d, *fragments, run=None, **kw):
    run = run or Run(_ctx(), zero=0, seed=11)
    before = _params(run.model)
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(out=None).load(d, **run.objects(), **kw)
    for frag in fragments:
        assert frag in str(e.value), str(e.value)
    for n, p in run.model.named_parameters():       # nothing touched
        assert torch.equal(p, before[n]), n
    assert run.sched.num_steps == 0 and not run.opt.inner.state
    return str(e.value)


def test_truncated_file_is_named(saved, tmp_path):
    d = _copy(saved, tmp_path / "c")
    data = os.path.join(d, "iter_0000002", "__0_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    _expect_error(d, data, "truncated")


def test_missing_metadata_and_bad_latest(saved, tmp_path):
    d = _copy(saved, tmp_path / "c")
    os.remove(os.path.join(d, "iter_0000002", ".metadata"))
    _expect_error(d, os.path.join(d, "iter_0000002", ".metadata"), "missing")
    d2 = _copy(saved, tmp_path / "c2")
    latest = os.path.join(d2, "latest")
    with open(latest, "w") as f:
        f.write("\x00garbage")
    _expect_error(d2, latest, "corrupt")
    with open(latest, "w") as f:
        f.write("iter_0000009\n")
    _expect_error(d2, latest, "iter_0000009", "missing")
    os.remove(latest)
    _expect_error(d2, "latest", "iter_0000002")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint_dir(str(tmp_path / "nowhere"))


def test_config_mismatch_names_each_field(saved):
    cfg = model_config(hidden_size=64, num_layers=3)
    msg = _expect_error(saved, "model config hidden_size: checkpoint 32, this run 64",
                        "model config num_layers: checkpoint 2, this run 3", run=Run(_ctx(), zero=0, cfg=cfg))
    assert "key(s) missing from the checkpoint" in msg and "layers.2." not in msg   # counted: the fields say why


def test_missing_and_unexpected_keys_are_listed(saved, tmp_path):
    tool = load_tool()
    pt = str(tmp_path / "full.pt")
    tool.export(saved, pt)
    sd = torch.load(pt, weights_only=True)
    sd["model"]["layers.0.mlp.extra.weight"] = torch.zeros(3)
    del sd["model"]["final_layernorm.bias"]
    sd["model_config"] = None
    torch.save(sd, pt)
    tool.import_(pt, str(tmp_path / "imp"))
    _expect_error(str(tmp_path / "imp"), "missing from the checkpoint: model.final_layernorm.bias",
                  "unexpected key(s) in the checkpoint (not in this model): model.layers.0.mlp.extra.weight")


def test_dcp_base_exception_becomes_checkpoint_error(saved, tmp_path):
    from megareshard.checkpoint import Piece, read_pieces
    with pytest.raises(CheckpointError, match="reading checkpoint"):
        read_pieces(os.path.join(saved, "iter_0000002"),
                    {"model.no.such.key": Piece(torch.zeros(2), (2,), (0,))}, [])


# ---- tools/checkpoint_util.py -------------------------------------------------------------------------
def test_checkpoint_util_inspect_export_import_roundtrip(saved, tmp_path, capsys):
    tool = load_tool()
    assert tool.main(["inspect", saved]) == 0
    out = capsys.readouterr().out
    assert "iteration 2" in out and "tp 1 · pp 1 · dp 1 · zero 0" in out
    assert "model.embedding.word_embeddings.weight" in out and "(100, 32)" in out
    assert tool.main(["inspect", saved, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["keys"]["optim.exp_avg.layers.1.mlp.fc2.weight"]["shape"] == [32, 128]

    pt = str(tmp_path / "out.pt")
    assert tool.main(["export", saved, pt]) == 0
    # usable outside the framework: a fresh interpreter, weights_only load, no process group
    check = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import torch
        sd = torch.load({pt!r}, weights_only=True)
        assert sd["model"]["embedding.word_embeddings.weight"].shape == (100, 32)
        assert "output_layer.weight" not in sd["model"] and sd["iteration"] == 2
        assert sd["optimizer"]["layers.0.attention.qkv.weight"]["exp_avg"].abs().sum() > 0
        print("ok")
    """)], capture_output=True, text=True, timeout=60)
    assert check.stdout.strip() == "ok", check.stderr
    a = Run(_ctx(), zero=0, seed=12)
    CheckpointManager(out=None).load(saved, **a.objects())
    sd = torch.load(pt, weights_only=True)
    for n, p in a.model.named_parameters():       # export is unpadded; the model's padding rows are zero
        rows = sd["model"][n].shape[0]
        assert torch.equal(sd["model"][n], p[:rows]) and not p[rows:].any(), n

    out_dir = str(tmp_path / "imported")
    assert tool.main(["import", pt, out_dir]) == 0
    b = Run(_ctx(), zero=0, seed=13)
    res = CheckpointManager(out=None).load(out_dir, **b.objects())
    assert res.iteration == 2 and res.loaded_optimizer
    for n, p in b.model.named_parameters():
        assert torch.equal(sd["model"][n], p[:sd["model"][n].shape[0]]), n
    for e1, e2 in zip(a.opt.entries, b.opt.entries):
        s1, s2 = a.opt.inner.state[e1.master], b.opt.inner.state[e2.master]
        assert all(torch.equal(s1[k], s2[k]) for k in s1), e1.name
    assert tool.main(["inspect", str(tmp_path / "missing")]) == 2


def test_dp_changed_compares_dp_not_stage_counts():
    """pp 2 -> 4 at dp 2 keeps dp (the loader used to say "data: dp changed 2 -> 2")."""
    from megareshard.checkpoint.manager import dp_changed

    assert not dp_changed([[2, 2], [2, 2]], [[1, 2]] * 4)          # tp/pp relayout, dp 2 kept
    assert not dp_changed([[1, 4], [2, 2]], [[1, 4], [2, 2]])
    assert dp_changed([[2, 2], [2, 2]], [[1, 8]])                   # dp 2 -> 8
    assert dp_changed([[1, 4], [2, 2]], [[2, 2], [2, 2]])           # per-stage 4,2 -> 2
    assert dp_changed([[1, 4], [2, 2]], [[1, 2], [2, 4]])           # same values, other stages
    assert dp_changed(None, [[1, 2]])                               # no saved layout: say so
