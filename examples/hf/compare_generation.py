"""Greedy continuation of one prompt by transformers (from_pretrained of the exported directory) and by
tools/generate.py's library on the megareshard checkpoint; prints both and exits 1 if they differ.

    python examples/hf/compare_generation.py HF_DIR CKPT "prompt" [--max-new-tokens N]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hf_dir")
    p.add_argument("ckpt")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=int, default=12)
    a = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megareshard.generation import generate_ids, load_for_generation

    tok = AutoTokenizer.from_pretrained(a.hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(a.hf_dir).eval()          # float32, as exported
    ids = tok(a.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = hf.generate(ids, max_new_tokens=a.max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.eos_token_id)[0].tolist()
    model, cfg = load_for_generation(a.ckpt)
    ours = generate_ids(model, cfg, ids[0].tolist(), max_new_tokens=a.max_new_tokens)
    n = len(ids[0])
    print(f"transformers : {a.prompt}{tok.decode(theirs[n:])!r}")
    print(f"megareshard  : {a.prompt}{tok.decode(ours[n:])!r}")
    same = theirs == ours
    print("greedy continuations " + ("identical" if same else f"DIFFER: {theirs[n:]} vs {ours[n:]}"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
