"""Thin wrapper: `python benchmarks/profile_step.py ARGS` (not profile.py: that would shadow the stdlib module) == `roseinfer bench profile ARGS` (see --help)."""

from __future__ import annotations

import sys

from roseinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "profile", *sys.argv[1:]]))
