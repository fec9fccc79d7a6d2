"""``roseinfer serve --ray`` flags, ``serve run`` arguments, and life without Ray installed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from roseinfer.cli import build_parser
from roseinfer.ray_serve.options import AppArgs, ServeOptions

# Run with Ray made unimportable, as if the 'ray' extra were not installed.
WITHOUT_RAY = "import sys\nsys.modules['ray'] = None\n"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)


def test_serve_ray_flags_parse() -> None:
    args = build_parser().parse_args(["serve", "--ray", "--num-replicas", "3", "--routing",
                                      "round_robin", "--ray-address", "auto"])
    assert (args.ray, args.num_replicas, args.routing, args.ray_address) == (
        True, 3, "round_robin", "auto")
    assert not build_parser().parse_args(["serve"]).ray


def test_serve_run_args_become_engine_config_and_options() -> None:
    parsed = AppArgs.model_validate({"num_replicas": "3", "num_threads": "2",
                                     "num_kv_blocks": "64", "routing": "round_robin",
                                     "served_model_name": "a, b", "enable_prefix_caching": "true"})
    config, options = parsed.engine_config(), parsed.serve_options()
    assert (config.num_threads, config.num_kv_blocks, config.block_size) == (2, 64, 16)
    assert config.enable_prefix_caching and config.model is None
    assert (options.num_replicas, options.routing, options.replica_cpus) == (3, "round_robin", 2.0)
    assert options.served_model_names == ("a", "b")
    assert AppArgs().serve_options().served_model_names == ("SmolLM2-135M-Instruct",)
    with pytest.raises(ValidationError, match="num_replica"):
        AppArgs.model_validate({"num_replica": "2"})  # a typo is refused, not ignored
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"routing": "random"})
    with pytest.raises(ValueError, match="num_replicas"):
        ServeOptions(num_replicas=0)


def test_roseinfer_imports_without_ray_and_never_loads_it_unasked() -> None:
    imports = ("import roseinfer, roseinfer.cli, roseinfer.server.cli, roseinfer.server.app\n"
               "import roseinfer.ray_serve, roseinfer.ray_serve.options\n"
               "roseinfer.cli.build_parser().parse_args(['serve', '--ray'])\n")
    blocked = _python(WITHOUT_RAY + imports)
    assert blocked.returncode == 0, blocked.stderr
    probe = _python("import sys, json\n" + imports + "print(json.dumps(sorted("
                    "m for m in sys.modules if m == 'ray' or m.startswith('ray.'))))")
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout.strip().splitlines()[-1]) == []


def test_serve_ray_without_ray_is_a_clear_error() -> None:
    out = _python(WITHOUT_RAY + "from roseinfer.cli import main\n"
                  "sys.exit(main(['serve', '--ray', '--num-replicas', '1']))")
    assert out.returncode == 2, out.stderr
    assert "roseinfer[ray]" in out.stderr and "Traceback" not in out.stderr


def test_more_replica_threads_than_cores_is_refused() -> None:
    out = _python("import sys\nfrom roseinfer.cli import main\n"
                  "sys.exit(main(['serve', '--ray', '--num-replicas', '64', '--num-threads', '4']))")
    assert out.returncode == 2, out.stderr
    assert "lower --num-replicas or --num-threads" in out.stderr


def test_ingress_forwards_the_path_below_the_route_prefix() -> None:
    pytest.importorskip("ray.serve")
    from roseinfer.ray_serve.ingress import _app_path

    assert _app_path({"path": "/v1/models", "root_path": ""}) == "/v1/models"
    assert _app_path({"path": "/llm/v1/models", "root_path": "/llm"}) == "/v1/models"
    assert _app_path({"path": "/llm", "root_path": "/llm"}) == "/"


def test_serve_run_access_settings_reach_the_replicas() -> None:
    options = AppArgs.model_validate({"bind_host": "0.0.0.0", "allowed_hosts": "a.example, b",
                                      "allowed_origins": "http://ui.example:3000",
                                      "public_metrics": "true"}).serve_options()
    access = options.access
    assert not access.loopback_bound and access.public_metrics
    assert access.allowed_hosts == ("a.example", "b")
    assert access.host_allowed("a.example:8000") and not access.host_allowed("c.example")
    assert access.origin_listed("http://ui.example:3000")
    default = AppArgs.model_validate({}).serve_options().access
    assert default.loopback_bound and not default.host_allowed("rebind.attacker.example")
