#!/usr/bin/env python
"""Pretrain a GPT with tensor, sequence, pipeline and data parallelism. Launch with torchrun:

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 \
        --micro-batch-size 4 --global-batch-size 16 --train-iters 100 \
        --data-path data/stdlib_text_document --tokenizer-model data/tokenizer.model

Pipeline parallelism (stages on dp × tp meshes, boundaries resharded across meshes):
add e.g. ``--pipeline-model-parallel-size 2 --pipeline-schedule eager-1f1b
--delay-wgrad-compute --reshard-strategy broadcast`` (``--num-layers-per-stage 1,3`` for
an uneven split, ``--pipeline-trace trace.json`` to record the last iteration's timeline).

`--help` lists every flag. Runs on CPU processes (gloo) or GPUs (NCCL, --device cuda).
"""
import sys

from megareshard.arguments import parse_args
from megareshard.entry import run_entry_point


def pretrain(cfg, **kwargs):
    """``megareshard.training.pretrain``, imported once the arguments are parsed: ``--help`` and a bad flag
    answer at once, without loading torch."""
    from megareshard.training import pretrain as train

    return train(cfg, **kwargs)


def main(argv=None, *, hard_exit_after_peer_failure: bool = False) -> int:
    def run() -> None:
        cfg = parse_args(argv)
        if cfg.launch.validate_only:  # the launch scripts' check before torchrun
            from megareshard.inputs import validate_only

            print(validate_only(cfg), flush=True)
            return
        from megareshard.model_spec import get_model_spec

        split = None
        if cfg.generators.generator_layouts:  # the last ranks sample from the trainer's weights (issue #50)
            from megareshard.generators import pretrain_with_generators as split
        pretrain(cfg, model_spec=get_model_spec("gpt"), launch_split=split)  # Llama-style decoders: the GPT with flags

    return run_entry_point("pretrain_gpt.py", run, hard_exit_after_peer_failure=hard_exit_after_peer_failure)


if __name__ == "__main__":
    sys.exit(main(hard_exit_after_peer_failure=True))
