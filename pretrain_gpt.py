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
import os
import sys

from megareshard.arguments import ConfigError, parse_args
from megareshard.launch import PeerFailure, PreflightError
from megareshard.model_spec import get_model_spec
from megareshard.training import RunStopped, pretrain


def main(argv=None, *, hard_exit_after_peer_failure: bool = False) -> int:
    try:
        cfg = parse_args(argv)
        pretrain(cfg, model_spec=get_model_spec("gpt"))  # Llama-style decoders too: the GPT with flags
    except ConfigError as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    except (PeerFailure, PreflightError, *RunStopped) as e:  # RunStopped is a tuple: unpacked, since
        # `except` refuses a nested tuple (TypeError) the moment an exception reaches it
        # a missing, dead, stalled or cut-off rank; a failed checkpoint save; a non-finite loss or gradient:
        # every rank stops, named in one line
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        if hard_exit_after_peer_failure and isinstance(e, PeerFailure):
            # the process group broke mid-operation: tearing it down at exit can abort in C++ ("terminate
            # called without an active exception", SIGABRT) instead of exiting 1
            sys.stdout.flush()
            os._exit(1)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(hard_exit_after_peer_failure=True))
