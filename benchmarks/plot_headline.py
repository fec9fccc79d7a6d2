"""Draw the README's headline plot from the headline table in docs/performance.md.

The table (decode tok/s of the default model against llama.cpp, the first table whose
header starts ``| decode tok/s``) is the measurement; this only draws it, so the plot
and the table cannot disagree. Each cell holds one figure per round (``210.8 / 208.5``):
a bar is their mean, its whisker spans the rounds.

    .venv/bin/python benchmarks/plot_headline.py   # writes docs/headline.png
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def headline_table(markdown: str) -> tuple[list[str], dict[str, list[list[float]]]]:
    """(column names, row name -> per column the rounds' figures) of the first
    ``| decode tok/s`` table."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| decode tok/s"))
    columns = [c.strip() for c in lines[start].strip("|").split("|")][1:]
    rows: dict[str, list[list[float]]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        name, *cells = [c.strip() for c in line.strip("|").split("|")]
        rows[name] = [[float(x) for x in cell.split("/")] for cell in cells]
    return columns, rows


def plot(columns: list[str], rows: dict[str, list[list[float]]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(rows)
    for k, (name, cells) in enumerate(rows.items()):
        xs = [i + (k - (len(rows) - 1) / 2) * width for i in range(len(columns))]
        means = [statistics.fmean(c) for c in cells]
        spans = [[m - min(c) for m, c in zip(means, cells, strict=True)],
                 [max(c) - m for m, c in zip(means, cells, strict=True)]]
        ax.bar(xs, means, width, yerr=spans, capsize=2, label=name.replace("`", ""))
    ax.set_xticks(range(len(columns)), [f"batch {c.removeprefix('batch ')}" for c in columns])
    ax.set_ylabel("decode tok/s (higher is better)")
    ax.set_title("SmolLM2-135M Q4_1, 2-core AVX2 CPU, 2 threads")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=ROOT / "docs" / "performance.md")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "headline.png")
    args = parser.parse_args()
    columns, rows = headline_table(args.source.read_text(encoding="utf-8"))
    plot(columns, rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
