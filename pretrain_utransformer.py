#!/usr/bin/env python
"""Pretrain a U-Transformer (the paper's §5.2 model: long skip connections between mirrored levels).

Same flags as ``pretrain_gpt.py`` plus the U's shape; ``--num-layers`` and ``--hidden-size``
are derived (number of blocks, top width). Launch with torchrun, e.g. a 4-stage pipeline
whose skip tensors cross non-adjacent stages, each stage with its own layout::

    torchrun --nproc-per-node 8 pretrain_utransformer.py --mock-data --vocab-size 512 \
        --u-levels 3 --u-widths 64,128,256 --u-blocks-per-level 1 --u-shorten-factor 2 \
        --u-skip-merge add --num-attention-heads 4 --seq-length 64 \
        --stage-layouts tp1dp2,tp2dp1,tp2dp1,tp1dp2 --num-layers-per-stage 1,1,1,2 \
        --pipeline-schedule eager-1f1b --delay-wgrad-compute --reshard-strategy broadcast \
        --micro-batch-size 2 --global-batch-size 16 --train-iters 50

`--help` lists every flag. See ``megareshard/models/utransformer.py`` for the architecture and
``megareshard/models/utransformer_spec.py`` for its model spec.
"""
import sys

from megareshard.arguments import parse_model_args
from megareshard.entry import run_entry_point
from megareshard.training import pretrain


def main(argv=None, *, hard_exit_after_peer_failure: bool = False) -> int:
    def run() -> None:
        cfg, spec = parse_model_args("utransformer", argv)  # + the U's --u-* flags
        if cfg.launch.validate_only:  # the launch scripts' check before torchrun
            from megareshard.inputs import validate_only

            print(validate_only(cfg), flush=True)
            return
        pretrain(cfg, model_spec=spec)

    return run_entry_point("pretrain_utransformer.py", run, hard_exit_after_peer_failure=hard_exit_after_peer_failure)


if __name__ == "__main__":
    sys.exit(main(hard_exit_after_peer_failure=True))
