"""Flags parse into typed configs; every validation error names the values and the reason."""
import re

import pytest

from megareshard.arguments import ConfigError, ModelConfig, TrainingConfig, build_parser, parse_args

BASE = ["--mock-data", "--vocab-size", "1000"]


def test_flags_parse_into_typed_sections():
    cfg = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                             "--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4",
                             "--micro-batch-size", "2", "--global-batch-size", "16", "--sequence-parallel",
                             "--lr", "1e-3", "--rank-order", "tp-dp-pp"], world_size=8)
    assert cfg.tp == 2 and cfg.pp == 2 and cfg.plan.dp == 2
    assert cfg.model.ffn_hidden_size == 512 and cfg.model.max_position_embeddings == 256
    assert cfg.parallel.sequence_parallel is True and cfg.training.lr == 1e-3
    assert cfg.plan.num_microbatches == 4
    assert cfg.training.lr_decay_iters == cfg.training.train_iters
    assert cfg.to_dict()["model"]["hidden_size"] == 128


def test_global_batch_defaults_to_micro_times_dp():
    cfg = parse_args(BASE + ["--micro-batch-size", "3"], world_size=4)
    assert cfg.training.global_batch_size == 12


def test_every_field_has_help():
    for cls in (ModelConfig, TrainingConfig):
        for f in cls.__dataclass_fields__.values():
            assert f.metadata["help"], f.name
    assert "--micro-batch-size" in build_parser().format_help()


@pytest.mark.parametrize("argv, world, message", [
    (["--global-batch-size", "30", "--micro-batch-size", "4"], 2, "global batch 30 is not divisible by micro batch 4 × dp 2 = 8"),
    (["--num-layers", "6", "--pipeline-model-parallel-size", "4"], 4, "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4; give --num-layers-per-stage"),
    (["--num-layers", "6", "--pipeline-model-parallel-size", "2", "--num-layers-per-stage", "2,3"], 2, "must give 2 positive numbers"),
    (["--bf16", "--fp16"], 1, "--bf16 and --fp16 conflict"),
    (["--loss-scale", "8"], 1, "--loss-scale 8.0 only applies with --fp16"),
    (["--recompute-num-layers", "2"], 1, "--recompute-num-layers 2 needs --recompute-granularity full"),
    (["--recompute-activations", "--recompute-granularity", "full"], 1, "conflicts with --recompute-granularity full"),
    (["--zero-stage", "4"], 1, None),
    (["--overlap-grad-reduce", "--zero-stage", "1"], 1, "--overlap-grad-reduce needs --use-distributed-optimizer or --zero-stage 2 or 3 (got --zero-stage 1)"),
    (["--delay-wgrad-compute"], 1, "--delay-wgrad-compute needs --pipeline-model-parallel-size > 1"),
    (["--num-attention-heads", "6", "--hidden-size", "96", "--tensor-model-parallel-size", "4"], 4, "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    (["--hidden-size", "100", "--num-attention-heads", "8"], 1, "--hidden-size 100 is not divisible by --num-attention-heads 8"),
    (["--tensor-model-parallel-size", "4"], 6, "world size 6 is not divisible by tensor-model-parallel-size 4"),
    (["--ffn-hidden-size", "30", "--tensor-model-parallel-size", "4"], 4, "--ffn-hidden-size 30 is not divisible"),
    (["--sequence-parallel", "--seq-length", "30", "--tensor-model-parallel-size", "4"], 4, "--seq-length 30 divisible"),
    (["--max-position-embeddings", "64", "--seq-length", "128"], 1, "--max-position-embeddings 64 is smaller than --seq-length 128"),
    (["--hidden-dropout", "1.5"], 1, "--hidden-dropout must be in"),
    (["--rank-order", "tp-xp-pp"], 1, "unknown axis 'xp'"),
    (["--nproc-per-node", "3"], 4, "world size 4 is not a multiple of --nproc-per-node 3"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], 1, "--min-lr 0.001"),
    (["--lr-warmup-iters", "50", "--train-iters", "10"], 1, "--lr-warmup-iters 50 is longer than the decay"),
    (["--split", "a,b"], 1, "--split 'a,b' must be comma-separated numbers"),
    (["--micro-batch-size", "0"], 1, "--micro-batch-size must be at least 1, got 0"),
    (["--clip-grad", "-1"], 1, "--clip-grad must be >= 0"),
])
def test_validation_errors(argv, world, message):
    if message is None:  # argparse rejects it (a choice outside the allowed ones): one line naming the choices
        with pytest.raises(ConfigError, match=r"invalid choice: .* \(choose from "):
            parse_args(BASE + argv, world_size=world)
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(BASE + argv, world_size=world)


def test_data_source_conflicts():
    with pytest.raises(ConfigError, match="--mock-data and --data-path d conflict"):
        parse_args(BASE + ["--data-path", "d"], world_size=1)
    with pytest.raises(ConfigError, match="no training data"):
        parse_args([], world_size=1)
    with pytest.raises(ConfigError, match="--mock-data needs --vocab-size"):
        parse_args(["--mock-data"], world_size=1)
    with pytest.raises(ConfigError, match="--data-path d needs a tokenizer"):
        parse_args(["--data-path", "d"], world_size=1)


@pytest.mark.parametrize("old, new", [("--batch-size", "--micro-batch-size"),
                                      ("--model-parallel-size", "--tensor-model-parallel-size"),
                                      ("--warmup", "--lr-warmup-iters")])
def test_deprecated_flags_name_the_replacement(old, new):
    with pytest.raises(ConfigError, match=f"{old} is deprecated: use {new}"):
        parse_args(BASE + [old, "2"], world_size=1)


def test_sequence_parallel_without_tp_warns():
    with pytest.warns(UserWarning, match="shards nothing"):
        parse_args(BASE + ["--sequence-parallel"], world_size=1)


def test_no_abbreviations():
    with pytest.raises(ConfigError, match="unknown flag\\(s\\) --micro: neither megareshard's nor one of the "
                                          "Megatron-LM flags it knows"):
        parse_args(BASE + ["--micro", "2"], world_size=1)


@pytest.mark.parametrize("extra, refused", [
    (["--optimizer", "adam", "--dataloader-type", "single"], None),   # Megatron-LM's defaults: what runs here
    (["--use-dist-ckpt", "--dist-ckpt-format", "torch_dist", "--ckpt-fully-parallel-save"], None),  # deprecated
    (["--dist-ckpt-format", "torch"], "--dist-ckpt-format torch (checkpoint formats other than torch_dist; only "
                                      "torch_dist is accepted)"),
    (["--optimizer", "sgd"], "--optimizer sgd (optimizers other than Adam with decoupled weight decay; only adam "
                             "is accepted)"),
    (["--dataloader-type", "cyclic"], "--dataloader-type cyclic (the cyclic and external data loaders; only single"),
    (["--eod-mask-loss", "--reset-position-ids"], "--eod-mask-loss (loss masking at end-of-document tokens), "
                                                  "--reset-position-ids (position ids restarting at document"),
    (["--no-save-optim"], "--no-save-optim (checkpoints without the optimizer state)"),
])
def test_megatron_data_and_optimizer_flags_run_or_are_named(extra, refused):
    """Megatron-LM flags a GPT script commonly passes: its defaults are what megareshard does; anything else is named
    as a feature not built (not as an unknown flag)."""
    if refused is None:
        assert parse_args(BASE + extra, world_size=1).training.train_iters
        return
    with pytest.raises(ConfigError, match="not supported by megareshard: " + re.escape(refused)):
        parse_args(BASE + extra, world_size=1)


def test_signal_strategy_needs_the_nan_check_off():
    # signal's stage inputs are undefined: a NaN loss would stop the run, so the flag must say it is a benchmark
    argv = BASE + ["--pipeline-model-parallel-size", "2", "--custom-import", "lab.signal", "--reshard-strategy", "signal"]
    with pytest.raises(ConfigError, match="add --no-check-for-nan-in-loss-and-grad"):
        parse_args(argv, world_size=2)
    cfg = parse_args(argv + ["--no-check-for-nan-in-loss-and-grad"], world_size=2)
    assert cfg.pipeline.reshard_strategy == "signal" and not cfg.training.check_for_nan_in_loss_and_grad


def test_wandb_project_without_wandb_is_refused_on_every_rank(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="--wandb-project mr needs the wandb package, which is not installed"):
        parse_args(BASE + ["--wandb-project", "mr"], world_size=1)
