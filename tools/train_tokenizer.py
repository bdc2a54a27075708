#!/usr/bin/env python
"""Train a lossless sentencepiece tokenizer (BPE or unigram) on text files.

The tool is megareshard/cli/train_tokenizer.py, also the command ``megareshard-train-tokenizer``;
this script needs megareshard installed (``pip install -e .``, the README's setup).
"""
from megareshard.cli import as_script, train_tokenizer

as_script(globals(), train_tokenizer)
