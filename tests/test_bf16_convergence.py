"""bf16 (bf16 parameters, fp32 masters) converges like fp32 on the quick start's kind of data."""
import io

import pytest
import torch

from megareshard.arguments import parse_args
from megareshard.parallel import ParallelContext
from megareshard.training import Trainer

ITERS = 50


def _losses(data, *extra, device="cpu"):
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                      "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(ITERS),
                      "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "5", "--device", device,
                      "--data-path", str(data / "text"), "--tokenizer-model", str(data / "tok.model"),
                      "--split", "100,0,0", "--hidden-dropout", "0", "--attention-dropout", "0", *extra], world_size=1)
    trainer = Trainer(cfg, ParallelContext.single_process(), torch.device(device), out=io.StringIO())
    return [r["loss"] for r in trainer.train()]


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (lab/bench/gpu_checks.py runs it on one)"))])
def test_bf16_loss_within_2_percent_of_fp32_after_50_iterations(stdlib_text, device):
    torch.set_num_threads(1)
    fp32 = _losses(stdlib_text, device=device)
    bf16 = _losses(stdlib_text, "--bf16", device=device)
    assert fp32[-1] < 0.9 * fp32[0], "fp32 learns"
    # the same batches in both runs: compare the last iterations (mean of 5 smooths batch-to-batch noise)
    last32, last16 = sum(fp32[-5:]) / 5, sum(bf16[-5:]) / 5
    assert abs(last16 - last32) / last32 < 0.02, (last32, last16)
