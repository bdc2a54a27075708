"""The checks of the training schedule, the data, the checkpoint flags and --deterministic-mode (part of
`config_checks.validate`, which calls them on its own copy of the configuration: they fill Megatron's derived
defaults there — --train-iters from --train-samples, the decay length, the data paths read from files)."""
from __future__ import annotations

from .config import CheckpointConfig, Config, TrainingConfig
from .config_fields import ConfigError
from .data.config import DataConfig

__all__ = ["validate_schedule", "validate_data", "validate_checkpoint", "validate_deterministic"]


def validate_schedule(t: "TrainingConfig") -> None:
    """Iterations or samples (one of each pair), Megatron's warm-up and decay rules; fills --train-iters."""
    for a, b, x, y in (("--train-iters", "--train-samples", t.train_iters, t.train_samples),
                       ("--lr-decay-iters", "--lr-decay-samples", t.lr_decay_iters, t.lr_decay_samples),
                       ("--lr-wsd-decay-iters", "--lr-wsd-decay-samples", t.lr_wsd_decay_iters,
                        t.lr_wsd_decay_samples)):
        if x is not None and y is not None:
            raise ConfigError(f"{a} {x} and {b} {y} conflict: count the schedule in iterations or in samples")
    for name, value in (("--train-iters", t.train_iters), ("--train-samples", t.train_samples),
                        ("--lr-decay-iters", t.lr_decay_iters), ("--lr-decay-samples", t.lr_decay_samples)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if t.train_samples is not None:
        if t.train_samples < t.global_batch_size:
            raise ConfigError(f"--train-samples {t.train_samples} is less than one global batch "
                              f"({t.global_batch_size} samples)")
        t.train_iters = t.train_samples // t.global_batch_size
    elif t.train_iters is None:
        t.train_iters = 100
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise ConfigError(f"learning rates must satisfy 0 <= --min-lr <= --lr and --lr > 0, got "
                          f"--lr {t.lr}, --min-lr {t.min_lr}")
    if t.decoupled_min_lr is not None and t.decoupled_lr is None:
        raise ConfigError(f"--decoupled-min-lr {t.decoupled_min_lr} needs --decoupled-lr")
    if t.decoupled_lr is not None:
        low = t.decoupled_min_lr if t.decoupled_min_lr is not None else t.min_lr
        if t.decoupled_lr <= 0 or low < 0 or low > t.decoupled_lr:
            raise ConfigError(f"decoupled learning rates must satisfy 0 <= minimum <= --decoupled-lr and "
                              f"--decoupled-lr > 0, got --decoupled-lr {t.decoupled_lr}, minimum {low}")
    for name, value in (("--lr-warmup-iters", t.lr_warmup_iters), ("--lr-warmup-samples", t.lr_warmup_samples),
                        ("--lr-warmup-init", t.lr_warmup_init)):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
    if t.lr_warmup_fraction is not None and not 0.0 <= t.lr_warmup_fraction <= 1.0:
        raise ConfigError(f"--lr-warmup-fraction must be in [0, 1], got {t.lr_warmup_fraction}")
    if t.lr_warmup_fraction is not None and (t.lr_warmup_iters or t.lr_warmup_samples):
        raise ConfigError(f"--lr-warmup-fraction {t.lr_warmup_fraction} conflicts with --lr-warmup-iters "
                          f"{t.lr_warmup_iters} / --lr-warmup-samples {t.lr_warmup_samples}: give one")
    if t.lr_warmup_iters and t.lr_warmup_samples:
        raise ConfigError(f"--lr-warmup-iters {t.lr_warmup_iters} and --lr-warmup-samples {t.lr_warmup_samples} "
                          "conflict: give one")
    if t.lr_decay_iters is None and t.lr_decay_samples is None:
        if t.train_samples is not None:
            t.lr_decay_samples = t.train_samples
        else:
            t.lr_decay_iters = t.train_iters
    from .optim.lr_scheduler import schedule_from_config

    sched = schedule_from_config(t)
    if sched.warmup_steps > sched.decay_steps and t.lr_decay_style != "constant":
        what = "--lr-warmup-iters" if t.lr_warmup_iters else "--lr-warmup-samples"
        raise ConfigError(f"{what} {t.lr_warmup_iters or t.lr_warmup_samples} is longer than the decay "
                          f"(--lr-decay-iters {t.lr_decay_iters}, --lr-decay-samples {t.lr_decay_samples}): "
                          f"{sched.warmup_steps} warm-up samples > {sched.decay_steps} decay samples")
    if t.lr_decay_style == "WSD" and sched.wsd_decay_steps is None:
        raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")


def validate_data(cfg: "Config") -> None:
    """One data source; blends parse; a tokenizer (or --vocab-size) for real data."""
    from .data.config import parse_blend

    d, m = cfg.data, cfg.model
    _read_data_args_files(d)
    split_paths = [p for p in (d.train_data_path, d.valid_data_path, d.test_data_path) if p]
    if d.mock_data and (d.data_path or split_paths):
        given = d.data_path or split_paths[0]
        raise ConfigError(f"--mock-data and --data-path {' '.join(given)} conflict: use one of them")
    if d.data_path and split_paths:
        raise ConfigError("--data-path conflicts with --train-data-path/--valid-data-path/--test-data-path: "
                          "give one blend split by --split, or one per split")
    if split_paths and not d.train_data_path:
        raise ConfigError("--valid-data-path/--test-data-path need --train-data-path")
    if not d.mock_data and not d.data_path and not split_paths:
        raise ConfigError("no training data: give --data-path PREFIX (with a tokenizer) or --mock-data")
    for flag, value in (("--data-path", d.data_path), ("--train-data-path", d.train_data_path),
                        ("--valid-data-path", d.valid_data_path), ("--test-data-path", d.test_data_path)):
        if value:
            try:
                parse_blend(value)
            except ValueError as e:
                raise ConfigError(f"{flag}: {e}") from None
    has_tokenizer = d.tokenizer_type is not None or d.tokenizer_model or d.vocab_file or d.merge_file
    if d.mock_data and m.vocab_size is None and not has_tokenizer:
        raise ConfigError("--mock-data needs --vocab-size (there is no tokenizer to take it from)")
    if d.tokenizer_type == "NullTokenizer" and m.vocab_size is None:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
    if (d.data_path or split_paths) and not has_tokenizer and m.vocab_size is None:
        given = " ".join(d.data_path or d.train_data_path)
        raise ConfigError(f"--data-path {given} needs a tokenizer (--tokenizer-type with --tokenizer-model, or "
                          "--vocab-file and --merge-file) or --vocab-size")


def _read_data_args_files(d: "DataConfig") -> None:
    """--data-args-path / --per-split-data-args-path: the data paths read from files, as Megatron-LM does."""
    import json

    if d.data_args_path:
        if d.data_path:
            raise ConfigError("--data-args-path and --data-path conflict: give one")
        try:
            with open(d.data_args_path, encoding="utf-8") as f:
                d.data_path = f.read().split()
        except OSError as e:
            raise ConfigError(f"--data-args-path {d.data_args_path}: {e.strerror}") from None
        d.data_args_path = None
    if d.per_split_data_args_path:
        if d.train_data_path or d.valid_data_path or d.test_data_path:
            raise ConfigError("--per-split-data-args-path conflicts with --train/valid/test-data-path: give one")
        try:
            with open(d.per_split_data_args_path, encoding="utf-8") as f:
                per_split = json.load(f)
        except OSError as e:
            raise ConfigError(f"--per-split-data-args-path {d.per_split_data_args_path}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"--per-split-data-args-path {d.per_split_data_args_path}: not JSON ({e})") from None
        if not isinstance(per_split, dict) or not set(per_split) <= {"train", "valid", "test"}:
            raise ConfigError(f"--per-split-data-args-path {d.per_split_data_args_path}: expected an object with "
                              "'train', 'valid' and 'test' keys")
        for key in ("train", "valid", "test"):
            value = per_split.get(key)
            if isinstance(value, str):
                value = value.split()
            setattr(d, f"{key}_data_path", [str(v) for v in value] if value else None)
        d.per_split_data_args_path = None


def validate_deterministic(cfg: Config) -> None:
    """--deterministic-mode refuses, in one line, what it cannot make deterministic (Megatron-LM refuses
    FlashAttention too; its fused cross-entropy, which it also refuses, is its own kernel: ours is element-wise
    PyTorch, deterministic under torch.use_deterministic_algorithms)."""
    if not cfg.training.deterministic_mode:
        return
    cannot = []
    backend = cfg.model.attention_backend
    if backend == "flash":
        cannot.append("--attention-backend flash (FlashAttention's backward accumulates with atomics; Megatron-LM "
                      "refuses it too)")
    elif backend == "fused":
        cannot.append("--attention-backend fused (PyTorch does not make cuDNN attention's backward deterministic)")
    mode = cfg.compile.torch_compile_mode
    if cfg.compile.torch_compile is not False and mode.startswith("max-autotune"):
        cannot.append(f"--torch-compile-mode {mode} (it chooses kernels by timing them)")
    if cannot:
        raise ConfigError(f"--deterministic-mode cannot make {'; '.join(cannot)} deterministic: use --attention-"
                          "backend auto (a fixed kernel with a deterministic backward) or unfused, and "
                          "--torch-compile-mode default")


def validate_checkpoint(ck: "CheckpointConfig") -> None:
    for name, value in (("--save-interval", ck.save_interval), ("--exit-interval", ck.exit_interval)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if ck.save_retain_interval is not None and ck.save_retain_interval < 1:
        raise ConfigError(f"--save-retain-interval must be at least 1, got {ck.save_retain_interval}")
    if ck.save_retain_latest < 0:
        raise ConfigError(f"--save-retain-latest must be at least 0 (0: keep every checkpoint), got "
                          f"{ck.save_retain_latest}")
    needs_save = [flag for flag, on in (("--save-interval", ck.save_interval is not None),
                                        ("--save-retain-latest", ck.save_retain_latest > 0),
                                        ("--save-retain-interval", ck.save_retain_interval is not None),
                                        ("--exit-signal-handler", ck.exit_signal_handler),
                                        ("--async-save", ck.async_save)) if on]
    if needs_save and not ck.save:
        raise ConfigError(f"{', '.join(needs_save)} need(s) --save DIR (where the checkpoint goes)")
    needs_load = [flag for flag, on in (("--finetune", ck.finetune), ("--no-load-optim", ck.no_load_optim),
                                        ("--no-load-rng", ck.no_load_rng),
                                        ("--attention-backend-rechoose", ck.attention_backend_rechoose)) if on]
    if needs_load and not ck.load:
        raise ConfigError(f"{', '.join(needs_load)} only appl(y/ies) with --load DIR")
