#!/usr/bin/env python
"""Tokenize text into memory-mapped indexed datasets (Megatron-LM's .bin/.idx format), with Megatron-LM's command line.

The tool is megareshard/cli/preprocess_data.py, also the command ``megareshard-preprocess-data``;
this script needs megareshard installed (``pip install -e .``, the README's setup).
"""
from megareshard.cli import as_script, preprocess_data

as_script(globals(), preprocess_data)
