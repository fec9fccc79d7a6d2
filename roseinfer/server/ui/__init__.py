"""The web UI: static files (chat + dashboard) and the JSON shape of the dashboard.

``static/`` holds plain HTML, CSS and ES-module JavaScript shipped as package data (no
build step, no CDN); ``assets.UiAssets`` loads them once per app, ``snapshot_json``
turns an ``EngineSnapshot`` into the body of ``GET /ui/api/snapshot``. The routes are
in ``roseinfer/server/routes_ui.py``.
"""

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"
