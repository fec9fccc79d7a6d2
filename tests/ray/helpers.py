"""Test helpers for the Ray Serve app: which routing the module's app runs with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RayApp:
    """The cluster's URL and the routing the app is deployed with (None: not deployed)."""

    url: str
    routing: str | None = None

    def use(self, routing: str) -> str:
        """Deploy the app with ``routing`` (fresh replicas) unless it already runs so."""
        from benchmarks.ray_routing import deploy, remove_app

        if self.routing != routing:
            if self.routing is not None:
                remove_app()
                self.routing = None
            deploy(routing, num_replicas=2)
            self.routing = routing
        return self.url
