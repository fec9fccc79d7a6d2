"""Thin wrapper: `python benchmarks/throughput.py ARGS` == `roseinfer bench throughput ARGS` (see --help)."""

from __future__ import annotations

import sys

from roseinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
