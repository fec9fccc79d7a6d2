"""The runnable code blocks of README.md and docs/*.md run, so the docs stay true.

A block is runnable when the line before its fence is ``<!-- doc-test [flags] -->``
(an HTML comment: invisible on the page). Flags: ``slow`` (loads the default model:
``@pytest.mark.slow``), ``server`` (talks to ``roseinfer serve`` on 127.0.0.1:8000: the
test starts one on the default model on a free port, shared by the module, and points
the block at it). ``python`` blocks run in a fresh interpreter, ``bash`` blocks in
``bash -euo pipefail`` with this interpreter's ``bin`` (``roseinfer``) first on PATH;
both must exit 0 within their timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server.helpers import STARTUP_TIMEOUT_S, free_port, stop_process, wait_healthy

ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- doc-test(?P<flags>(?: [a-z]+)*) -->$")
FENCE = re.compile(r"^```(?P<lang>[a-z]+)$")
FLAGS = {"slow", "server"}
LANGS = {"python", "bash"}
BLOCK_TIMEOUT_S = 180
DOC_PORT = "127.0.0.1:8000"


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the fence, 1-based
    lang: str
    flags: frozenset[str]
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def collect(path: Path) -> Iterator[Block]:
    """The marked blocks of one Markdown file; a malformed marker is an error."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        marker = MARKER.match(line.strip())
        if marker is None:
            if line.lstrip().startswith("<!-- doc-test"):
                raise ValueError(f"{path}:{i + 1}: malformed marker {line!r}")
            continue
        flags = frozenset(marker["flags"].split())
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None or fence["lang"] not in LANGS or not flags <= FLAGS:
            raise ValueError(f"{path}:{i + 1}: a doc-test marker needs known flags "
                             f"({sorted(FLAGS)}) and a ```python or ```bash fence after it")
        end = lines.index("```", i + 2)
        yield Block(path, i + 2, fence["lang"], flags, "\n".join(lines[i + 2:end]) + "\n")


BLOCKS = [b for path in DOCS for b in collect(path)]


def _param(block: Block) -> object:
    slow = bool(block.flags & {"slow", "server"})
    return pytest.param(block, id=block.id, marks=[pytest.mark.slow] if slow else [])


@pytest.fixture(scope="module")
def doc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``roseinfer serve`` on the default model; yields its ``host:port``."""
    port = free_port()
    log = tmp_path_factory.mktemp("doc-server") / "serve.log"
    cmd = [sys.executable, "-m", "roseinfer.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--kv-cache-memory-gb", "0.25", "--no-ui", "--no-warmup"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=_env())
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, STARTUP_TIMEOUT_S, log)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(proc)


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PYTHONPATH": str(ROOT), "PATH": path, "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def test_the_docs_have_runnable_blocks() -> None:
    """The collector finds the blocks it should (a marker typo would skip them)."""
    ids = {b.id.split(":")[0] for b in BLOCKS}
    assert {"README.md", "docs/offline-api.md"} <= ids, ids
    assert any("server" in b.flags for b in BLOCKS)
    assert any(b.lang == "bash" for b in BLOCKS)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_doc_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    code = block.code
    if "server" in block.flags:
        assert DOC_PORT in code, f"{block.id}: a server block talks to {DOC_PORT}"
        code = code.replace(DOC_PORT, request.getfixturevalue("doc_server"))
    cmd = ([sys.executable, "-c", code] if block.lang == "python"
           else ["bash", "-euo", "pipefail", "-c", code])
    try:
        out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                             timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.id} ran past {BLOCK_TIMEOUT_S} s")
    assert out.returncode == 0, (f"{block.id} exited {out.returncode}:\n{out.stdout[-3000:]}\n"
                                 f"{out.stderr[-3000:]}")
    assert out.stdout.strip(), f"{block.id} printed nothing"
