"""Progress of the slow first start of a model (loading and converting its weights).

On a terminal (stderr is a TTY) each step is a tqdm bar or a line on stderr (bars are
cleared when done); otherwise (logs, pipes, servers under a supervisor) a log line when
a step starts and one when it ends, with its duration.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

logger = logging.getLogger("roseinfer.model")
T = TypeVar("T")


def on_terminal() -> bool:
    """True when progress bars can be drawn (stderr is an interactive terminal)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def note(message: str) -> None:
    """A one-line notice: on stderr on a terminal, else an INFO log line."""
    if on_terminal():
        print(f"roseinfer: {message}", file=sys.stderr, flush=True)
    else:
        logger.info("%s", message)


@contextlib.contextmanager
def step(desc: str) -> Iterator[None]:
    """A step without a count (``desc ... done in 1.2 s``)."""
    start = time.perf_counter()
    terminal = on_terminal()
    if terminal:
        print(f"roseinfer: {desc} ...", end="", file=sys.stderr, flush=True)
    else:
        logger.info("%s ...", desc)
    try:
        yield
    finally:
        took = time.perf_counter() - start
        if terminal:
            print(f" {took:.1f} s", file=sys.stderr, flush=True)
        else:
            logger.info("%s: %.1f s", desc, took)


def progress(items: Iterable[T], desc: str, total: int | None = None,
             unit: str = "tensor") -> Iterator[T]:
    """Yield ``items``, showing ``desc`` progress (see the module docstring)."""
    start = time.perf_counter()
    if on_terminal():
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, total=total, unit=unit, leave=False,
                        file=sys.stderr, dynamic_ncols=True)
        logger.info("%s: done in %.1f s", desc, time.perf_counter() - start)
        return
    logger.info("%s ...", desc)
    count = 0
    for item in items:
        count += 1
        yield item
    logger.info("%s: %d %ss in %.1f s", desc, count, unit, time.perf_counter() - start)
