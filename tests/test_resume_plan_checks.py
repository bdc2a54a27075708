"""Resumes and the training plan (issue #51): what a resume's --load holds, set against the new run's plan at
start-up, in one line each.

* a checkpoint past --train-iters (or whose data position the plan's samples cannot cover) is one line and exit
  2 before anything is built, not the sampler's traceback on every rank;
* a checkpoint at --train-iters says there is nothing left to train, exit 0;
* --validate-only checks --load (exists, holds a megareshard or Megatron-LM checkpoint), --save (not a file) and
  the checkpoint's recorded iteration and consumed samples (checkpoint.json, as JSON) without torch;
* --load of a Hugging Face model directory, or of a Megatron-LM directory it cannot read, names the converter.

One real checkpoint (two iterations of a tiny model, in process); every other run stops before its model is built.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megareshard.arguments import ConfigError
from megareshard.checkpoint import detect

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "2", "--device", "cpu",
        "--eval-interval", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _main():
    sys.path.insert(0, str(ROOT))
    try:
        from pretrain_gpt import main
    finally:
        sys.path.remove(str(ROOT))
    return main


def _line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A megareshard checkpoint root after 2 iterations of global batch 4 (8 samples consumed)."""
    root = tmp_path_factory.mktemp("resume") / "ck"
    assert _main()(TINY + ["--global-batch-size", "4", "--train-iters", "2", "--save", str(root)]) == 0
    assert (root / "latest").read_text().strip() == "iter_0000002"
    return root


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = _main()(TINY + argv)
    out, err = capsys.readouterr()
    return code, out, err


# ---- 1. past the plan: one line at start-up --------------------------------------------------------------------
def test_resume_past_train_iters_is_one_line_before_anything_is_built(ckpt, capsys):
    code, out, err = _run(capsys, ["--global-batch-size", "4", "--train-iters", "1", "--load", str(ckpt)])
    assert code == 2, err
    assert _line(err) == (f"pretrain_gpt.py: error: the checkpoint in {ckpt / 'iter_0000002'} has consumed 8 "
                          "samples (iteration 2); --train-iters 1 × global batch 4 = 4 samples: nothing is left to "
                          "train; raise --train-iters above 2")
    assert "building the model" not in out
    # --train-samples says so in its own terms; --finetune starts at iteration 0: nothing to check
    code, _, err = _run(capsys, ["--global-batch-size", "4", "--train-samples", "6", "--load", str(ckpt)])
    assert code == 2 and "--train-samples 6: 1 iteration × global batch 4 = 4 samples" in _line(err), err
    assert "raise --train-samples to at least 12" in err


@pytest.mark.parametrize("iters", [3, 5])
def test_resume_with_a_smaller_global_batch_that_runs_out_of_samples_is_one_line(ckpt, capsys, iters):
    """Saved at 8 samples (2 × 4); at global batch 2 the plan holds 2 × iters samples but the iterations left need
    samples 8..: today a ValueError on every rank (iters 3) or a StopIteration mid-run (iters 5)."""
    code, out, err = _run(capsys, ["--global-batch-size", "2", "--train-iters", str(iters), "--load", str(ckpt)])
    assert code == 2, err
    line = _line(err)
    assert (f"has consumed 8 samples (iteration 2); --train-iters {iters} × global batch 2 = {2 * iters} samples, "
            "too few") in line and "it was saved at global batch 4: resume with --global-batch-size 4" in line, line
    assert "building the model" not in out


# ---- 2. at the plan: nothing left to train ---------------------------------------------------------------------
def test_resume_at_train_iters_says_nothing_is_left_and_exits_0(ckpt, capsys):
    code, out, err = _run(capsys, ["--global-batch-size", "4", "--train-iters", "2", "--load", str(ckpt),
                                   "--save", str(ckpt)])
    assert code == 0 and err == "", err
    assert (f"megareshard: nothing left to train: the checkpoint in {ckpt / 'iter_0000002'} is at iteration 2 = "
            "--train-iters 2; raise --train-iters to train on") in out, out
    assert "building the model" not in out and sorted(os.listdir(ckpt)) == [".megareshard.lock", "iter_0000002",
                                                                            "latest"]


# ---- 3. --validate-only checks the checkpoint flags ------------------------------------------------------------
def test_validate_only_checks_load_save_and_the_recorded_progress(ckpt, tmp_path, capsys):
    v = ["--validate-only", "--global-batch-size", "4"]
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("x")
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    refused = {  # argv -> what the one line says
        ("--load", str(tmp_path / "chekpoint")): "does not exist: is the path mistyped?",
        ("--load", str(junk)): "holds 1 entry and no checkpoint",
        ("--save", str(afile)): f"--save {afile} is a file of 15 bytes, not a directory",
        ("--save", str(afile / "sub")): f"--save {afile / 'sub'}: {afile} is a file",
        ("--load", str(ckpt), "--train-iters", "1"): "has consumed 8 samples (iteration 2); --train-iters 1 × "
                                                     "global batch 4 = 4 samples: nothing is left to train",
    }
    for argv, says in refused.items():
        code, out, err = _run(capsys, v + list(argv))
        assert code == 2 and says in _line(err) and out == "", (argv, out, err)
    accepted = {
        ("--load", str(ckpt), "--train-iters", "5"): f"; --load {ckpt / 'iter_0000002'}: iteration 2, 8 samples "
                                                     "consumed; training iterations 3-5",
        ("--load", str(ckpt), "--train-iters", "2"): "; nothing left to train: the checkpoint in",
        ("--load", str(ckpt), "--train-iters", "1", "--finetune"): "(--finetune: its weights, from iteration 0)",
        ("--load", str(tmp_path / "new"), "--save", str(tmp_path / "new")): "holds no checkpoint yet: training starts",
    }
    for argv, says in accepted.items():
        code, out, err = _run(capsys, v + list(argv))
        assert code == 0 and out.count("\n") == 1 and says in out, (argv, out, err)
    # a root whose latest names a missing directory, and a checkpoint.json that is not JSON: the loader's lines
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "latest").write_text("iter_0000009\n")
    (broken / "iter_0000003").mkdir()
    (broken / "iter_0000003" / "checkpoint.json").write_text("{not json")
    for load, says in ((broken, "latest names iter_0000009, but"), (broken / "iter_0000003", "is corrupt")):
        code, _, err = _run(capsys, v + ["--load", str(load)])
        assert code == 2 and says in _line(err), err


def test_validate_only_with_a_checkpoint_imports_no_torch(ckpt):
    code = ("import runpy, sys\nsys.argv = ['pretrain_gpt.py'] + sys.argv[1:]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    print('exit', e.code)\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')")
    argv = TINY + ["--validate-only", "--global-batch-size", "4", "--train-iters", "1", "--load", str(ckpt)]
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE="1"))
    assert p.stdout.rstrip().endswith("exit 2\nNO TORCH"), (p.stdout, p.stderr)
    assert "has consumed 8 samples (iteration 2)" in _line(p.stderr)


# ---- 4. a Hugging Face or Megatron-LM directory names its converter --------------------------------------------
def test_load_of_a_hugging_face_directory_names_import_hf(tmp_path, capsys):
    hf = tmp_path / "llama"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "model.safetensors").write_bytes(b"\0" * 8)
    for argv in ([], ["--validate-only"]):
        code, out, err = _run(capsys, argv + ["--global-batch-size", "4", "--train-iters", "1", "--load", str(hf)])
        assert code == 2 and "building the model" not in out, err
        assert _line(err) == (f"pretrain_gpt.py: error: --load {hf} is a Hugging Face model directory (config.json, "
                              f"model.safetensors), not a checkpoint: convert it once with python "
                              f"tools/checkpoint_util.py import-hf {hf} OUT, then --load OUT")
    bin_dir = tmp_path / "gpt2"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text("{}")
    (bin_dir / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(ConfigError, match="import-hf"):
        detect.load_decision(str(bin_dir), None)


def test_megatron_directories_it_cannot_read_name_import_megatron(tmp_path, capsys):
    loose = tmp_path / "copied_iteration"              # an iteration directory out of its root, renamed
    (loose / "mp_rank_00").mkdir(parents=True)
    root = tmp_path / "mg"
    (root / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("10\n")
    for argv in (["--validate-only"], []):
        code, out, err = _run(capsys, argv + ["--global-batch-size", "4", "--load", str(loose)])
        assert code == 2 and "python tools/checkpoint_util.py import-megatron ROOT OUT" in _line(err), err
        assert "building the model" not in out
    with pytest.raises(ConfigError, match=f"import-megatron {root} OUT"):   # (a run reads this one directly)
        detect.load_decision(str(root), None)
    code, out, err = _run(capsys, ["--validate-only", "--global-batch-size", "4", "--load", str(root)])
    assert code == 0 and "is a Megatron-LM checkpoint root" in out and "as --finetune" in out, err


def test_the_torch_free_reading_agrees_with_the_loader(tmp_path, ckpt):
    """detect.py repeats a few of format.py's and megatron_io.py's rules so as not to import torch."""
    from megareshard.checkpoint import format as fmt
    from megareshard.checkpoint.megatron_load import megatron_checkpoint_dir

    assert (detect.CHECKPOINT_JSON, detect.LATEST_FILE, detect.TMP_PREFIX) == (fmt.CHECKPOINT_JSON, fmt.LATEST_FILE,
                                                                               fmt.TMP_PREFIX)
    progress = detect.read_progress(str(ckpt))
    assert progress == detect.Progress(str(ckpt / "iter_0000002"), 2, 8, 4, kernel_choices=progress.kernel_choices)
    assert fmt.resolve_checkpoint_dir(str(ckpt)) == detect.read_progress(str(ckpt)).directory
    cases = {"iter_0000010": ["mp_rank_00"], "iter_0000011": ["mp_rank_00_001"], "release": ["metadata.json"],
             "iter_12": ["mp_rank_00"], "iter_0000013": ["mp_rank_0"], "step5": ["metadata.json"]}
    for name, inside in cases.items():
        for entry in inside:
            target = tmp_path / name / entry
            target.mkdir(parents=True) if entry.startswith("mp_") else (target.parent.mkdir(), target.write_text("{}"))
        assert detect.megatron_iteration(str(tmp_path / name)) == megatron_checkpoint_dir(str(tmp_path / name)), name
    assert detect.megatron_iteration(str(ckpt)) is None is megatron_checkpoint_dir(str(ckpt))
