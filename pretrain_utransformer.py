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
import os
import sys

from megareshard.arguments import ConfigError, parse_model_args
from megareshard.launch import PeerFailure, PreflightError
from megareshard.training import RunStopped, pretrain


def main(argv=None, *, hard_exit_after_peer_failure: bool = False) -> int:
    try:
        cfg, spec = parse_model_args("utransformer", argv)  # + the U's --u-* flags
        pretrain(cfg, model_spec=spec)
    except ConfigError as e:
        print(f"pretrain_utransformer.py: error: {e}", file=sys.stderr)
        return 2
    except (PeerFailure, PreflightError, *RunStopped) as e:  # RunStopped is a tuple: unpacked, since
        # `except` refuses a nested tuple (TypeError) the moment an exception reaches it
        # a missing, dead, stalled or cut-off rank; a failed checkpoint save; a non-finite loss or gradient:
        # every rank stops, named in one line
        print(f"pretrain_utransformer.py: error: {e}", file=sys.stderr, flush=True)
        if hard_exit_after_peer_failure and isinstance(e, PeerFailure):
            # the process group broke mid-operation: tearing it down at exit can abort in C++ ("terminate
            # called without an active exception", SIGABRT) instead of exiting 1
            sys.stdout.flush()
            os._exit(1)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(hard_exit_after_peer_failure=True))
