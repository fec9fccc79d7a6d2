"""Who may talk to the server: the Host names it answers, the browser origins it serves
(CORS) and whether ``/metrics`` needs the API key (``AccessSettings``), with the pure
matching rules the ``HostGuardMiddleware`` applies.

The rules (docs/serving-security.md):

* Host. A server bound to a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``)
  answers only loopback Host names (``localhost``, ``127.x.x.x``, ``[::1]``) and those in
  ``allowed_hosts``: a page whose DNS name was rebound to 127.0.0.1 sends its own name
  as Host and is refused. Bound to any other address (``0.0.0.0``, a LAN address), any
  Host is answered unless ``allowed_hosts`` is given; then only loopback names and those
  listed. ``"*"`` in ``allowed_hosts`` answers any Host. A request without a Host header
  (HTTP/1.0 tools) is answered: browsers always send one.
* Origin. A request that carries an ``Origin`` header (browsers add it to cross-origin
  and to non-GET requests) is served only when the origin is the server itself (same
  name and port as the Host) or listed in ``allowed_origins`` (``"*"``: any); a listed
  origin gets CORS headers, its preflight included.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

ANY = "*"
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class AccessSettings:
    bind_host: str = "127.0.0.1"  # the address the server listens on
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides the loopback ones
    allowed_origins: tuple[str, ...] = ()  # browser origins served, with CORS headers
    public_metrics: bool = False  # /metrics open without the API key

    def __post_init__(self) -> None:
        hosts = tuple(_normal_host_entry(h) for h in self.allowed_hosts)
        origins = tuple(_normal_origin_entry(o) for o in self.allowed_origins)
        object.__setattr__(self, "allowed_hosts", hosts)
        object.__setattr__(self, "allowed_origins", origins)

    @property
    def loopback_bound(self) -> bool:
        return is_loopback_name(self.bind_host.strip("[]").lower())

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether a request with this Host header is answered."""
        if host_header is None:
            return True
        parsed = split_host(host_header)
        if parsed is None:
            return False
        name = parsed[0]
        if is_loopback_name(name) or ANY in self.allowed_hosts or name in self.allowed_hosts:
            return True
        return not self.loopback_bound and not self.allowed_hosts

    def origin_listed(self, origin: str) -> bool:
        """Whether ``origin`` is served cross-origin (with CORS headers)."""
        return ANY in self.allowed_origins or _normal_origin(origin) in self.allowed_origins

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        """Whether a browser request from ``origin`` to ``host_header`` is served."""
        return same_origin(origin, host_header) or self.origin_listed(origin)


def is_loopback_name(name: str) -> bool:
    """``localhost`` or a loopback IP (``127.0.0.0/8``, ``::1``); ``name`` lower-case, no
    brackets, no port."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header (``name``, ``name:port``, ``[v6]``, ``[v6]:port``) as (lower-case
    name without a trailing dot, port); None when it is malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep:
            return None
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            return None
    else:
        name, sep, port_text = value.rpartition(":")
        if not sep:
            name, port_text = value, None
        if ":" in name:
            return None  # a bare IPv6 address must be bracketed
    name = name.removesuffix(".")
    if not name or any(c.isspace() or c in "/@?#\\" for c in name):
        return None
    if port_text is None:
        return name, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return name, int(port_text)


def _origin_parts(origin: str) -> tuple[str, str, int] | None:
    """``scheme://host[:port]`` as (scheme, name, port); None if it is not one."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or scheme not in _DEFAULT_PORTS or not rest or "/" in rest:
        return None
    parsed = split_host(rest)
    if parsed is None:
        return None
    name, port = parsed
    return scheme, name, _DEFAULT_PORTS[scheme] if port is None else port


def _normal_origin(origin: str) -> str | None:
    parts = _origin_parts(origin)
    if parts is None:
        return origin.strip().lower() if origin.strip().lower() == "null" else None
    scheme, name, port = parts
    name = f"[{name}]" if ":" in name else name
    return f"{scheme}://{name}" + ("" if port == _DEFAULT_PORTS[scheme] else f":{port}")


def same_origin(origin: str, host_header: str | None) -> bool:
    """The page making the request was served by this server: the origin's name and
    port are the Host's (a Host without a port stands for the origin scheme's default,
    as behind a TLS-terminating proxy)."""
    parts = _origin_parts(origin)
    host = split_host(host_header) if host_header is not None else None
    if parts is None or host is None:
        return False
    _, name, port = parts
    return name == host[0] and (host[1] is None or host[1] == port)


def _normal_host_entry(entry: str) -> str:
    if entry.strip() == ANY:
        return ANY
    parsed = split_host(entry)
    if parsed is None or parsed[1] is not None or "://" in entry:
        raise ValueError(f"allowed host {entry!r} must be a bare host name or IP "
                         "(no scheme, no port), or '*'")
    return parsed[0]


def _normal_origin_entry(entry: str) -> str:
    if entry.strip() == ANY:
        return ANY
    normal = _normal_origin(entry)
    if normal is None:
        raise ValueError(f"allowed origin {entry!r} must look like 'https://app.example' "
                         "or 'http://host:port' (scheme, host, optional port), 'null' or '*'")
    return normal
