"""Replicas behind Ray Serve: N roseinfer engines behind one OpenAI-compatible endpoint.

Ray is an optional extra (``pip install 'roseinfer[ray]'``): nothing in roseinfer
imports this package's modules unless asked to (``roseinfer serve --ray``, ``serve run
roseinfer.ray_serve.app:build_app``). ``require_ray`` says clearly when it is missing.

Modules: ``app`` (the application and how to run it), ``ingress`` (the HTTP entry),
``replica`` (an engine and its app), ``router`` (Ray Serve's request-router hook),
``routing_policy`` (prefix affinity / round-robin, no Ray), ``prefix_keys`` (prompt ->
block hashes), ``asgi_bridge`` (an HTTP request through an in-process ASGI app),
``options``.
"""

from __future__ import annotations

import importlib.util

INSTALL_HINT = "pip install 'roseinfer[ray]'  (or: pip install 'ray[serve]')"


def require_ray() -> None:
    """Raise ImportError with the install command when Ray Serve is not installed."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise ImportError(f"--ray needs Ray Serve, which is not installed: {INSTALL_HINT}")
    try:
        import ray.serve  # noqa: F401 - its extras (fastapi, uvicorn, ...) must import too
    except ImportError as exc:
        raise ImportError(f"Ray Serve does not import ({exc}): {INSTALL_HINT}") from exc
