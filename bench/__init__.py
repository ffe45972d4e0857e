"""Benchmarks for ckptfs: `python -m bench` (see bench/README.md)."""
