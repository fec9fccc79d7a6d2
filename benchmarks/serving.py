"""Thin wrapper: `python benchmarks/serving.py ARGS` == `roseinfer bench serve ARGS` (see --help)."""

from __future__ import annotations

import sys

from roseinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
