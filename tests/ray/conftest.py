"""Ray fixtures: ONE local Ray cluster on loopback for the module (2 CPUs, a small
object store, no dashboard) with Serve's proxy on a free 127.0.0.1 port, and the
roseinfer app on it: 2 engine replicas of the default model, 1 torch thread each,
a KV pool of ``DEFAULT_NUM_KV_BLOCKS`` each. Module scope: the cluster is gone before
the next test module runs.

Replicas inherit this process's environment (the session's weight cache dir among it:
tests/conftest.py sets it before Ray starts)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ray.helpers import RayApp


@pytest.fixture(scope="module")
def ray_app() -> Iterator[RayApp]:
    pytest.importorskip("ray.serve", reason="the 'ray' extra is not installed")
    import ray
    from ray import serve

    from benchmarks.ray_routing import start_ray

    app = RayApp(start_ray(num_cpus=2))
    try:
        yield app
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def prefix_app(ray_app: RayApp) -> str:
    """The app with prefix routing, deployed and ready; its base URL."""
    return ray_app.use("prefix")
