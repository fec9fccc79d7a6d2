"""UiAssets: the UI's static files, read once into memory and served by name.

Only files that exist in the static folder at startup are served (a fixed set of
names: no path is ever built from the URL), each with its content type, an ETag and
``no-cache`` (the browser revalidates, so an upgraded package is picked up at once).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".json": "application/json",
}


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


class UiAssets:
    """Every file of ``static_dir`` with a known content type, keyed by file name."""

    def __init__(self, static_dir: Path) -> None:
        self.files: dict[str, Asset] = {}
        for path in sorted(static_dir.iterdir()):
            ctype = CONTENT_TYPES.get(path.suffix)
            if ctype is None or not path.is_file():
                continue
            body = path.read_bytes()
            etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
            self.files[path.name] = Asset(body, ctype, etag)
        if "index.html" not in self.files:
            raise FileNotFoundError(f"index.html missing from {static_dir}")

    def get(self, name: str) -> Asset | None:
        return self.files.get(name)
