"""Issue #53 part 1 on CPU: the attention kernel choice of ``--attention-backend auto`` is reproducible (a margin a
less preferred kernel must beat, ties to the preferred one, the reason in the log), recorded with the run's
checkpoints and reused on resume (``--attention-backend-rechoose`` chooses again; a checkpoint from before the
record means "choose"), and ``--deterministic-mode`` (Megatron-LM's) applies, refuses in one line what it cannot
serve, and gives bitwise-identical CPU runs. Timings are injected (``fusion.AUTO_TIMING``, with the CPU as a
measured device type)."""
from __future__ import annotations

import io
import json
import os
import random

import pytest
import torch

from megareshard.arguments import parse_args
from megareshard.config_fields import ConfigError
from megareshard.models import fusion
from megareshard.training import Trainer, build_context

MODEL = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
         "--log-interval", "100", "--device", "cpu", "--train-iters", "2"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]  # flash on CPU has no dropout


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    """Each test chooses afresh, and the process's deterministic-algorithms switch comes back as it was."""
    monkeypatch.setattr(fusion, "_CHOICES", {})
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def _fake_timing(monkeypatch, seconds: dict[str, float]) -> list:
    """auto measures on the CPU too, with these timings; returns the list of shapes measured."""
    measured: list = []

    def measure(shape, dtype, device, dropout_p):
        measured.append(shape)
        return dict(seconds)

    monkeypatch.setattr(fusion, "AUTO_TIMING", fusion.AutoTiming(measure, device_types=("cpu", "cuda")))
    return measured


def _trainer(argv):
    cfg = parse_args(MODEL + argv, world_size=1)
    ctx, _ = build_context(cfg, 1)
    out = io.StringIO()
    return Trainer(cfg, ctx, torch.device("cpu"), out=out), out


def _attention_line(out: io.StringIO) -> str:
    line = next(x for x in out.getvalue().splitlines() if x.startswith("megareshard: fast path:"))
    return line[line.index("attention "):line.index("; cross-entropy")]


# ---- the rule ------------------------------------------------------------------------------------------------
def test_pick_kernel_margin_ties_preference_and_reason():
    # within the margin the preferred one is kept, and the log says why
    assert fusion.pick_kernel({"flash": 0.39e-3, "efficient": 0.38e-3}) == (
        "flash", "auto: flash 0.39 ms, efficient 0.38 ms: flash kept (efficient within the 5 % margin; flash "
                 "preferred)")
    assert fusion.pick_kernel({"cudnn": 0.32e-3, "efficient": 0.31e-3})[0] == "cudnn"
    # a tie goes to the preference order whatever order the timings come in
    assert fusion.pick_kernel({"efficient": 1.0, "cudnn": 1.0, "flash": 1.0})[0] == "flash"
    assert fusion.pick_kernel({"efficient": 1.0, "cudnn": 1.0})[0] == "cudnn"
    # beyond the margin the faster one wins, named with what it beat
    kernel, why = fusion.pick_kernel({"flash": 0.50e-3, "cudnn": 0.52e-3, "efficient": 0.40e-3})
    assert kernel == "efficient" and why.endswith("efficient chosen (faster than flash and cudnn by more than the "
                                                  "5 % margin)")
    assert fusion.pick_kernel({"flash": 0.30e-3, "efficient": 0.40e-3})[1].endswith("flash fastest")
    assert fusion.pick_kernel({"efficient": 0.4e-3})[1].endswith("efficient, the only kernel that runs this shape")
    # the margin is a parameter: at 30 % the slower preferred kernel is kept
    assert fusion.pick_kernel({"flash": 0.50e-3, "efficient": 0.40e-3}, margin=0.3)[0] == "flash"


def test_choice_is_reproducible_under_jitter():
    """Timings that move by less than the margin's slack keep the choice (before: the fastest of the moment won,
    so two kernels within noise flipped from start to start)."""
    rng = random.Random(0)
    for base, expected in (({"flash": 0.39, "cudnn": 0.41, "efficient": 0.40}, "flash"),
                           ({"flash": 0.50, "cudnn": 0.32, "efficient": 0.315}, "cudnn"),
                           ({"flash": 0.60, "cudnn": 0.60, "efficient": 0.40}, "efficient")):
        for _ in range(200):
            jittered = {k: v * (1 + rng.uniform(-0.01, 0.01)) for k, v in base.items()}
            assert fusion.pick_kernel(jittered)[0] == expected, jittered


def test_choose_attention_kernel_uses_injected_timing():
    shape = (2, 4, 4, 16, 8)
    timing = fusion.AutoTiming(lambda *a: {"flash": 1.0, "efficient": 0.99}, device_types=("cpu",))
    kernel, why = fusion.choose_attention_kernel("auto", shape=shape, dtype=torch.float32, device=torch.device("cpu"),
                                                 dropout_p=0.0, timing=timing)
    assert kernel == "flash" and "flash kept (efficient within the 5 % margin; flash preferred)" in why
    # on a device auto does not measure: PyTorch's choice, said so
    kernel, why = fusion.choose_attention_kernel("auto", shape=shape, dtype=torch.float32, device=torch.device("cpu"),
                                                 dropout_p=0.0)
    assert (kernel, why) == ("sdpa", "--attention-backend auto on cpu: PyTorch's choice, not measured")
    # --deterministic-mode measures nothing
    kernel, why = fusion.choose_attention_kernel("auto", shape=shape, dtype=torch.float32, device=torch.device("cpu"),
                                                 dropout_p=0.0, timing=timing, deterministic=True)
    assert kernel == "sdpa" and "--deterministic-mode" in why and "not measured" in why


# ---- the record in a checkpoint and its reuse -------------------------------------------------------------------
def test_choice_recorded_in_checkpoint_and_reused_on_resume(monkeypatch, tmp_path):
    save = str(tmp_path / "ck")
    measured = _fake_timing(monkeypatch, {"flash": 1.0e-3, "efficient": 1.2e-3})
    t, out = _trainer(NO_DROPOUT + ["--save", save])
    assert _attention_line(out).startswith("attention flash (--attention-backend auto: flash 1.00 ms, efficient "
                                           "1.20 ms: flash fastest)")
    first = [r["loss"] for r in t.train()]
    t.close()
    assert len(first) == 2 and len(measured) == 1
    info = json.load(open(os.path.join(save, "iter_0000002", "checkpoint.json")))
    (key, entry), = info["kernel_choices"]["attention"].items()
    assert key == "auto batch 2 heads 4 groups 4 seq 16 head 8 float32 cpu dropout 0"
    assert entry["kernel"] == "flash" and "flash fastest" in entry["why"]

    # resumed with a measurement that would choose efficient: the recorded flash runs, and the log says so
    fusion._CHOICES.clear()
    measured = _fake_timing(monkeypatch, {"flash": 1.0e-3, "efficient": 0.5e-3})
    t, out = _trainer(NO_DROPOUT + ["--load", save, "--train-iters", "3"])
    line = _attention_line(out)
    assert line.startswith(f"attention flash, as recorded in the checkpoint {save}/iter_0000002 (--attention-backend "
                           "auto: flash 1.00 ms, efficient 1.20 ms: flash fastest; --attention-backend-rechoose "
                           "chooses again)"), line
    assert not measured and {layer.attention.kernel for layer in t.model.layers.values()} == {"flash"}
    assert t.model.kernel_choices["attention"][key]["kernel"] == "flash"   # recorded again by its saves
    assert len(t.train()) == 1
    t.close()

    # --attention-backend-rechoose measures again and says what the record held
    fusion._CHOICES.clear()
    t, out = _trainer(NO_DROPOUT + ["--load", save, "--train-iters", "3", "--attention-backend-rechoose"])
    line = _attention_line(out)
    assert line.startswith("attention efficient (--attention-backend auto: flash 1.00 ms, efficient 0.50 ms: efficient "
                           "chosen (faster than flash by more than the 5 % margin); chosen again: --attention-backend-"
                           f"rechoose, the checkpoint {save}/iter_0000002 recorded flash)"), line
    assert len(measured) == 1
    t.close()

    # --finetune is a new run: it chooses
    fusion._CHOICES.clear()
    t, out = _trainer(NO_DROPOUT + ["--load", save, "--finetune"])
    assert _attention_line(out).startswith("attention efficient (--attention-backend auto: flash 1.00 ms")
    t.close()


def test_checkpoint_without_record_means_choose(monkeypatch, tmp_path):
    save = str(tmp_path / "ck")
    t, out = _trainer(NO_DROPOUT + ["--save", save])
    assert _attention_line(out).startswith("attention sdpa (--attention-backend auto on cpu: PyTorch's choice, not "
                                           "measured)")
    t.train()
    t.close()
    path = os.path.join(save, "iter_0000002", "checkpoint.json")
    info = json.load(open(path))
    assert info["kernel_choices"]["attention"]["auto batch 2 heads 4 groups 4 seq 16 head 8 float32 cpu dropout "
                                               "0"]["kernel"] == "sdpa"
    # on CPU the unmeasured choice is recorded and kept on resume, said so
    t, out = _trainer(NO_DROPOUT + ["--load", save, "--train-iters", "3"])
    assert _attention_line(out).startswith(f"attention sdpa, as recorded in the checkpoint {save}/iter_0000002 "
                                           "(--attention-backend auto on cpu: PyTorch's choice, not measured")
    t.close()
    # a checkpoint from before the record (no kernel_choices in checkpoint.json): it loads, and the kernel is chosen
    del info["kernel_choices"]
    with open(path, "w") as f:
        json.dump(info, f)
    _fake_timing(monkeypatch, {"flash": 1.0e-3, "efficient": 0.99e-3})
    t, out = _trainer(NO_DROPOUT + ["--load", save, "--train-iters", "3"])
    line = _attention_line(out)
    assert line.startswith("attention flash (--attention-backend auto: flash 1.00 ms, efficient 0.99 ms: flash "
                           "kept (efficient within the 5 % margin; flash preferred); the checkpoint "), line
    assert line.endswith("recorded no choice for this shape)")
    assert t.iteration == 2 and len(t.train()) == 1
    t.close()


# ---- --deterministic-mode ------------------------------------------------------------------------------------
def test_deterministic_mode_parses_refuses_and_applies(monkeypatch):
    assert parse_args(MODEL, world_size=1).training.deterministic_mode is False
    for argv, what in ((["--attention-backend", "flash"], "--attention-backend flash (FlashAttention's backward"),
                       (["--use-flash-attn"], "--attention-backend flash"),
                       (["--attention-backend", "fused"], "--attention-backend fused"),
                       (["--torch-compile", "--torch-compile-mode", "max-autotune-no-cudagraphs"],
                        "--torch-compile-mode max-autotune-no-cudagraphs (it chooses kernels by timing them)")):
        with pytest.raises(ConfigError) as e:
            parse_args(MODEL + ["--deterministic-mode"] + argv, world_size=1)
        assert str(e.value).startswith("--deterministic-mode cannot make ") and what in str(e.value)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--attention-backend-rechoose only appl"):
        parse_args(MODEL + ["--attention-backend-rechoose"], world_size=1)

    torch.use_deterministic_algorithms(False)
    measured = _fake_timing(monkeypatch, {"flash": 1.0e-3, "efficient": 0.5e-3})
    t, out = _trainer(["--deterministic-mode"])
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    text = out.getvalue()
    assert "deterministic mode (torch.use_deterministic_algorithms, cuDNN deterministic)" in text
    assert not measured and "attention sdpa (--attention-backend auto under --deterministic-mode on cpu" in text
    t.close()

    # on CUDA it sets what Megatron-LM asks for where unset, and refuses an NCCL_ALGO Megatron-LM does not accept
    from megareshard.fast_path import _ENV_SET, apply_deterministic_mode
    cfg = parse_args(MODEL + ["--deterministic-mode", "--no-torch-compile"], world_size=1)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.setattr("megareshard.fast_path._ENV_SET", {})
    assert apply_deterministic_mode(cfg, torch.device("cuda")) == (
        "deterministic mode (torch.use_deterministic_algorithms, cuDNN deterministic, "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8, NCCL_ALGO=Ring)")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["NCCL_ALGO"] == "Ring"
    monkeypatch.setenv("NCCL_ALGO", "NVLS")
    with pytest.raises(ConfigError, match=r"^--deterministic-mode: NCCL_ALGO=NVLS is not one it can make "
                                          r"deterministic; unset it or use one of Ring, Tree"):
        apply_deterministic_mode(cfg, torch.device("cuda"))
    assert _ENV_SET == {}  # the module's own record was swapped out above, not touched
    # without the flag nothing is touched
    torch.use_deterministic_algorithms(False)
    assert apply_deterministic_mode(parse_args(MODEL, world_size=1), torch.device("cuda")) is None
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_mode_runs_are_bitwise_identical():
    """Two CPU runs of the same command with --deterministic-mode (dropout on): the same losses, bitwise."""
    runs = []
    for _ in range(2):
        t, _ = _trainer(["--deterministic-mode"])
        runs.append([r["loss"] for r in t.train()])
        t.close()
    assert len(runs[0]) == 2 and runs[0] == runs[1]
