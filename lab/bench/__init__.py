"""Benchmarks: each compares alternatives side by side in one run and reports ratios (docs/benchmarks.md)."""
