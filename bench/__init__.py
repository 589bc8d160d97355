"""Benchmarks: each prints a table and writes `results/*.json`; run them as `python -m bench.<name>`."""
