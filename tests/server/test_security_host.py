"""Host and Origin checks through a real uvicorn (tiny model): DNS rebinding (a foreign
Host) and cross-site requests (a foreign Origin) are refused on every route, listed
origins get CORS headers (preflight included, before the API key), and /metrics needs
the key unless it is public."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from roseinfer.server.access import AccessSettings, same_origin, split_host
from roseinfer.server.state import ServerSettings
from tests.server.helpers import TinyServer, tiny_server

REBIND = "rebind.attacker.example"
BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
ROUTES = (("POST", "/v1/completions"), ("GET", "/ui/api/snapshot"), ("GET", "/metrics"),
          ("GET", "/"), ("GET", "/v1/models"), ("POST", "/tokenize"), ("GET", "/health"))


@pytest.fixture(scope="module")
def ts() -> Iterator[TinyServer]:
    with tiny_server(ServerSettings(served_model_names=("tiny",), ui=True)) as server:
        yield server


def port(ts: TinyServer) -> int:
    return int(ts.url.rsplit(":", 1)[1])


def call(ts: TinyServer, method: str, path: str, **headers: str) -> httpx.Response:
    body = BODY if path == "/v1/completions" else {"prompt": [1]} if method == "POST" else None
    return httpx.request(method, ts.url + path, json=body, timeout=30,
                         headers={k.replace("_", "-"): v for k, v in headers.items()})


def assert_refused(r: httpx.Response, code: str) -> None:
    assert r.status_code == 403, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_dns_rebinding_host_is_refused_on_every_route(ts: TinyServer, method: str,
                                                      path: str) -> None:
    host = f"{REBIND}:{port(ts)}"
    r = call(ts, method, path, Host=host, Origin=f"http://{host}")
    assert_refused(r, "host_not_allowed")
    assert_refused(call(ts, method, path, Host=host), "host_not_allowed")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "LOCALHOST.", "127.0.0.2", "[::1]"])
def test_loopback_hosts_are_served(ts: TinyServer, host: str) -> None:
    r = call(ts, "POST", "/v1/completions", Host=f"{host}:{port(ts)}")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] is not None


def test_foreign_origin_is_refused_same_origin_is_served(ts: TinyServer) -> None:
    here = f"127.0.0.1:{port(ts)}"
    for path in ("/v1/completions", "/ui/api/snapshot", "/metrics"):
        method = "POST" if path == "/v1/completions" else "GET"
        assert_refused(call(ts, method, path, Origin="https://evil.example"),
                       "origin_not_allowed")
        assert_refused(call(ts, method, path, Origin="null"), "origin_not_allowed")
        # another loopback port is another origin (another local app)
        assert_refused(call(ts, method, path, Origin="http://localhost:1"),
                       "origin_not_allowed")
        r = call(ts, method, path, Origin=f"http://{here}")
        assert r.status_code == 200, r.text
        assert "access-control-allow-origin" not in r.headers
    # a preflight from a foreign origin gets no CORS grant
    r = call(ts, "OPTIONS", "/v1/completions", Origin="https://evil.example",
             Access_Control_Request_Method="POST")
    assert_refused(r, "origin_not_allowed")


def test_listed_origin_gets_cors_and_preflight_before_the_api_key() -> None:
    app_origin = "https://app.example"
    access = AccessSettings(allowed_origins=(app_origin, "http://tool.example:8080"))
    settings = ServerSettings(served_model_names=("tiny",), api_key="k", access=access)
    with tiny_server(settings) as ts:
        r = call(ts, "OPTIONS", "/v1/completions", Origin=app_origin,
                 Access_Control_Request_Method="POST",
                 Access_Control_Request_Headers="authorization, content-type, x-stainless-os")
        assert r.status_code == 204, r.text
        assert r.headers["access-control-allow-origin"] == app_origin
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "x-stainless-os" in r.headers["access-control-allow-headers"]
        assert "Origin" in r.headers["vary"]
        r = call(ts, "POST", "/v1/completions", Origin=app_origin, Authorization="Bearer k")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app_origin
        r = call(ts, "POST", "/v1/completions", Origin=app_origin)  # no key: 401, readable
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == app_origin
        r = call(ts, "GET", "/v1/models", Origin="http://TOOL.example:8080",
                 Authorization="Bearer k")
        assert r.status_code == 200
        assert_refused(call(ts, "GET", "/v1/models", Origin="http://tool.example",
                            Authorization="Bearer k"), "origin_not_allowed")


def test_allowed_hosts_and_non_loopback_binding() -> None:
    listed = AccessSettings(allowed_hosts=("rose.internal",))
    with tiny_server(ServerSettings(served_model_names=("tiny",), access=listed)) as ts:
        assert call(ts, "GET", "/v1/models", Host=f"rose.internal:{port(ts)}").status_code == 200
        assert_refused(call(ts, "GET", "/v1/models", Host=REBIND), "host_not_allowed")
    # bound to all interfaces: any Host, but a foreign Origin is still refused
    lan = AccessSettings(bind_host="0.0.0.0")
    with tiny_server(ServerSettings(served_model_names=("tiny",), access=lan)) as ts:
        assert call(ts, "GET", "/v1/models", Host="gpu-box.lan:8000").status_code == 200
        assert_refused(call(ts, "GET", "/v1/models", Host="gpu-box.lan:8000",
                            Origin="https://evil.example"), "origin_not_allowed")
        r = call(ts, "GET", "/v1/models", Host="gpu-box.lan:8000",
                 Origin="http://gpu-box.lan:8000")
        assert r.status_code == 200
    assert not AccessSettings(bind_host="0.0.0.0", allowed_hosts=("a.lan",)).host_allowed("b.lan")
    assert AccessSettings(bind_host="::1").loopback_bound
    assert AccessSettings(bind_host="localhost").loopback_bound
    assert AccessSettings(allowed_hosts=("*",)).host_allowed(REBIND)


def test_metrics_need_the_key_unless_public() -> None:
    keyed = ServerSettings(served_model_names=("tiny",), api_key="k")
    with tiny_server(keyed) as ts:
        r = call(ts, "GET", "/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = call(ts, "GET", "/metrics", Authorization="Bearer k")
        assert r.status_code == 200 and "roseinfer:" in r.text
        assert call(ts, "GET", "/health").status_code == 200
    public = ServerSettings(served_model_names=("tiny",), api_key="k",
                            access=AccessSettings(public_metrics=True))
    with tiny_server(public) as ts:
        assert call(ts, "GET", "/metrics").status_code == 200
        assert call(ts, "GET", "/v1/models").status_code == 401


def test_host_and_origin_parsing() -> None:
    assert split_host("Example.COM.:8000") == ("example.com", 8000)
    assert split_host("[::1]:80") == ("::1", 80)
    assert split_host("[::1]") == ("::1", None)
    for bad in ("::1", "a b", "x:99999", "x:port", "[::1", "user@host", ""):
        assert split_host(bad) is None, bad
    assert same_origin("http://localhost:8000", "localhost:8000")
    assert same_origin("https://box.lan", "box.lan")  # behind a TLS proxy
    assert not same_origin("http://localhost:8001", "localhost:8000")
    assert not same_origin("http://evil.example", "localhost")
    with pytest.raises(ValueError):
        AccessSettings(allowed_hosts=("http://x",))
    with pytest.raises(ValueError):
        AccessSettings(allowed_origins=("app.example",))
