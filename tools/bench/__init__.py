"""Benchmarks: each times one thing side by side with its baseline (`python -m tools.bench.NAME`;
figures and commands in docs/benchmarks.md). No user needs them to train."""
