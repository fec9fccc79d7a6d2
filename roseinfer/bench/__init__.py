"""Benchmarks: offline throughput, online serving load, and a per-step profile."""
