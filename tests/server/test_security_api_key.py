"""Where `roseinfer serve` takes its API key from (flag, file, environment), and that the
server's own options are checked before the model loads."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from roseinfer.cli import build_parser
from roseinfer.server.api_key import ENV_VAR, resolve_api_key


def test_sources_in_order(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    key_file.chmod(stat.S_IRUSR)
    env = {ENV_VAR: "from-env"}
    assert resolve_api_key("from-flag", None, env) == "from-flag"
    assert resolve_api_key(None, str(key_file), env) == "from-file"
    assert resolve_api_key(None, None, env) == "from-env"
    assert resolve_api_key(None, None, {}) is None
    assert resolve_api_key(None, None, {ENV_VAR: ""}) is None


MISSING = object()  # a path to a file that does not exist


@pytest.mark.parametrize(("flag", "content", "error"), [
    ("k", "k2", "not both"),
    (None, MISSING, "cannot read"),
    (None, "\n", "empty"),
    (None, "two words", "without spaces"),
    (None, "x" * 5000, "larger than"),
    (" ", None, "empty"),
])
def test_unusable_sources_are_errors(tmp_path: Path, flag: str | None, content: object,
                                     error: str) -> None:
    key_file = tmp_path / "key"
    if isinstance(content, str):
        key_file.write_text(content)
    path = None if content is None else str(key_file)
    with pytest.raises(ValueError, match=error):
        resolve_api_key(flag, path, {})


def test_serve_flags_parse() -> None:
    args = build_parser().parse_args([
        "serve", "--api-key-file", "/k", "--public-metrics", "--allowed-hosts", "a.lan", "b",
        "--allowed-origins", "https://app.example", "--request-timeout", "5",
        "--max-connections", "9", "--timeout-keep-alive", "2"])
    assert args.api_key_file == "/k" and args.public_metrics
    assert args.allowed_hosts == ["a.lan", "b"] and args.allowed_origins == ["https://app.example"]
    assert (args.request_timeout, args.max_connections, args.timeout_keep_alive) == (5.0, 9, 2)
    plain = build_parser().parse_args(["serve"])
    assert plain.api_key is None and not plain.public_metrics and plain.max_connections == 512


def test_bad_server_options_fail_before_the_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import roseinfer.server.cli as serve_cli

    def no_model(*_: object) -> None:
        raise AssertionError("the engine config was built")

    monkeypatch.setattr(serve_cli, "engine_config_from_args", no_model)
    monkeypatch.delenv(ENV_VAR, raising=False)
    for extra in (["--api-key-file", str(tmp_path / "missing")],
                  ["--allowed-origins", "app.example"], ["--request-timeout", "0"],
                  ["--max-connections", "0"]):
        args = build_parser().parse_args(["serve", *extra])
        assert args.func(args) == 2
        assert "error" in capsys.readouterr().err
