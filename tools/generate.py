#!/usr/bin/env python
"""Generate text from a checkpoint of any layout (one process): greedy, or top-p sampling.

    python tools/generate.py --load runs/ft --tokenizer-type HuggingFaceTokenizer --tokenizer-model hf_dir \\
        --prompt "def fibonacci(n):" --max-new-tokens 40
    ... --top-p 0.9 --temperature 0.8 --seed 1      # sampling instead of greedy

Tokenizer flags are Megatron-LM's (--tokenizer-type with --tokenizer-model, or --vocab-file and
--merge-file, or --vocab-size for NullTokenizer). Prints the prompt and the continuation; with
--ids also the token ids.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megareshard.checkpoint import CheckpointError  # noqa: E402
from megareshard.data.tokenizer import TokenizerError, build_tokenizer  # noqa: E402
from megareshard.generation import generate_ids, load_for_generation  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint root (its latest) or a checkpoint directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-type", default=None)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ids", action="store_true", help="also print the token ids")
    a = p.parse_args(argv)
    try:
        tok = build_tokenizer(a.tokenizer_type, tokenizer_model=a.tokenizer_model, vocab_file=a.vocab_file,
                              merge_file=a.merge_file, vocab_size=a.vocab_size)
        model, cfg = load_for_generation(a.load, a.device)
        if tok.vocab_size > cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the checkpoint's model {cfg.vocab_size}")
        prompt = tok.encode(a.prompt)
        ids = generate_ids(model, cfg, prompt, max_new_tokens=a.max_new_tokens, top_p=a.top_p,
                           temperature=a.temperature, seed=a.seed, eod=getattr(tok, "eod", None))
    except (TokenizerError, CheckpointError, ValueError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(f"{a.prompt}{tok.decode(ids[len(prompt):])}")
    if a.ids:
        print(ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
