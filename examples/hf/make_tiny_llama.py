"""Make a tiny random Llama and its tokenizer locally (no hub): a byte-level BPE trained on the Python
standard library's sources, and a LlamaForCausalLM sized for a CPU, saved with save_pretrained.

    python examples/hf/make_tiny_llama.py OUT_DIR CORPUS.jsonl [--docs N]

Writes OUT_DIR (config.json, model.safetensors, tokenizer files) and CORPUS.jsonl ({"text": ...} per
source file) for tools/preprocess_data.py.
"""
from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("corpus")
    p.add_argument("--docs", type=int, default=200, help="standard-library files in the corpus")
    p.add_argument("--vocab-size", type=int, default=512)
    a = p.parse_args()
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[: a.docs]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    Path(a.corpus).parent.mkdir(parents=True, exist_ok=True)
    with open(a.corpus, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=a.vocab_size, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(a.out_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=fast.eos_token_id,
                      bos_token_id=fast.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(a.out_dir)
    print(f"tiny Llama ({sum(1 for _ in cfg.to_dict())} config keys, vocabulary {len(fast)}) -> {a.out_dir}; "
          f"corpus of {len(texts)} documents -> {a.corpus}")


if __name__ == "__main__":
    main()
