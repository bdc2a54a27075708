"""Generate text from a checkpoint of any layout (one process): greedy, or top-p sampling.

    python tools/generate.py --load runs/quickstart/checkpoints --prompt "def fibonacci(n):" --max-new-tokens 40
    ... --top-p 0.9 --temperature 0.8 --seed 1      # sampling instead of greedy

``--load`` also reads a Megatron-LM checkpoint directory (torch_dist or per-rank torch files), as
pretrain_gpt.py --load does. The tokenizer is the one the checkpoint records (its type and files,
saved by the run that trained it, or by checkpoint_util.py import-hf / import-megatron), or that a
Megatron-LM run's saved arguments name.
Tokenizer flags, Megatron-LM's (--tokenizer-type with --tokenizer-model, or --vocab-file and
--merge-file, or --vocab-size for NullTokenizer), replace it, e.g. for an imported checkpoint. Ids the
tokenizer has beyond the model's vocabulary (special pieces Megatron-LM's SentencePieceTokenizer adds)
are never generated; a prompt that encodes to one is refused. Prints the prompt and the continuation;
with --ids also the token ids.
"""
from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

from megareshard.checkpoint import CheckpointError, read_info, resolve_checkpoint_dir
from megareshard.data.tokenizer import (TokenizerError, build_recorded_tokenizer, build_tokenizer,
                                        tokenizer_record)
from megareshard.generation import (TOKENIZER_FLAGS, generate_ids, load_for_generation, megatron_dir,
                                    recorded_tokenizer)


def checkpoint_tokenizer(load: str) -> dict | None:
    """The tokenizer a checkpoint records (type, absolute paths); for one saved before it recorded them, the
    tokenizer flags of its arguments (paths as the run gave them); for a Megatron-LM directory, the tokenizer its
    saved arguments name; None when it has none."""
    if megatron_dir(load) is not None:
        from megareshard.checkpoint.megatron_io import MegatronCheckpoint
        args = MegatronCheckpoint(load).args
        return tokenizer_record(SimpleNamespace(**{k: args.get(k) for k in TOKENIZER_FLAGS[:4]}))
    return recorded_tokenizer(read_info(resolve_checkpoint_dir(load)))


def load(a: argparse.Namespace):
    """(model, its config, tokenizer, note): a Megatron-LM directory's vocabulary is its tokenizer's (Megatron-LM
    padded that), so the tokenizer comes first there; elsewhere the checkpoint says its vocabulary."""
    if megatron_dir(a.load) is None:
        model, cfg = load_for_generation(a.load, a.device)
        return (model, cfg, *build(a, cfg.vocab_size))
    tok, note = build(a, None)
    model, cfg = load_for_generation(a.load, a.device, vocab_size=tok.vocab_size if tok is not None else None)
    if tok is None:                       # NullTokenizer by the saved arguments: its size is the model's
        tok, note = build(a, cfg.vocab_size)
    return model, cfg, tok, note


def build(a: argparse.Namespace, model_vocab: int | None):
    """The tokenizer of the flags given, else the checkpoint's; and a note when it is not the checkpoint's.
    ``model_vocab`` None (a Megatron-LM directory not yet read): None for a recorded NullTokenizer."""
    recorded = checkpoint_tokenizer(a.load)
    if any(getattr(a, k) is not None for k in TOKENIZER_FLAGS):
        tok = build_tokenizer(a.tokenizer_type, tokenizer_model=a.tokenizer_model, vocab_file=a.vocab_file,
                              merge_file=a.merge_file, vocab_size=a.vocab_size)
        mine = tokenizer_record(SimpleNamespace(**{k: getattr(a, k) for k in TOKENIZER_FLAGS[:4]}))
        note = None
        if recorded is not None and mine is not None and mine["type"] != recorded["type"]:
            note = f"the checkpoint was trained with a {recorded['type']} tokenizer; using {tok!r} as asked"
        return tok, note
    if recorded is None:
        raise TokenizerError(f"{a.load} records no tokenizer (imported weights, or trained on mock data): give "
                             "--tokenizer-type with --tokenizer-model (or --vocab-file and --merge-file)")
    if model_vocab is None and recorded["type"] == "NullTokenizer":
        return None, None
    try:
        return build_recorded_tokenizer(recorded, model_vocab or 0), None
    except TokenizerError as e:
        raise TokenizerError(f"the tokenizer {a.load} records ({recorded['type']}) cannot be built: {e}; give "
                             "--tokenizer-type and its files") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint root (its latest) or a checkpoint directory; or a "
                                                 "Megatron-LM checkpoint directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("tokenizer (default: the one the checkpoint records)")
    g.add_argument("--tokenizer-type", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ids", action="store_true", help="also print the token ids")
    a = p.parse_args(argv)
    try:
        model, cfg, tok, note = load(a)
        if note:
            print(f"note: {note}", file=sys.stderr)
        prompt = tok.encode(a.prompt)
        outside = sorted({i for i in prompt if not 0 <= i < cfg.vocab_size})
        if outside:
            raise ValueError(f"the prompt encodes to id(s) {outside[:5]} outside the model's vocabulary of "
                             f"{cfg.vocab_size} ids (tokenizer {tok!r}): the model has no embedding for them")
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
