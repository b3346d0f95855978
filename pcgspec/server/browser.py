"""What keeps a web page from using a server it can reach (an unkeyed one on loopback above all):
JSON-only POST bodies (no "simple" cross-site request carries one), a Host check on loopback
servers (DNS rebinding), and CORS headers only for the origins allowed.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pcgspec.server.validate import ApiError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
_PREFLIGHT_HEADERS = {
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Headers": "Authorization, Content-Type",
    "Access-Control-Max-Age": "600",
}


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The Host header without its port: ``[::1]:8000`` -> ``[::1]``, ``a.b:80`` -> ``a.b``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class BrowserPolicy:
    hosts: frozenset[str] | None  # Host names answered; None: any
    origins: frozenset[str]  # origins given CORS headers; "*" among them: any

    @classmethod
    def build(
        cls, bind: str, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...]
    ) -> BrowserPolicy:
        check = is_loopback(bind) and "*" not in allowed_hosts
        hosts = frozenset(map(host_name, LOOPBACK_HOSTS + allowed_hosts)) if check else None
        return cls(hosts, frozenset(o.rstrip("/").lower() for o in allowed_origins))

    def allows_origin(self, origin: str) -> bool:
        return bool(origin) and ("*" in self.origins or origin.lower() in self.origins)


POLICY: web.AppKey[BrowserPolicy] = web.AppKey("pcgspec_browser_policy", BrowserPolicy)


@web.middleware
async def browser_guard(request: web.Request, handler: Any) -> web.StreamResponse:
    """421 for a Host a loopback server does not go by, 415 for a POST body that is not JSON;
    answers CORS preflights from allowed origins."""
    policy = request.app[POLICY]
    host = request.headers.get("Host")
    if policy.hosts is not None and host is not None and host_name(host) not in policy.hosts:
        raise ApiError(
            421,
            f"this server does not answer for the host {host[:100]!r} (see --allowed-hosts)",
            code="host_not_allowed",
        )
    origin = request.headers.get("Origin", "")
    if request.method == "OPTIONS" and policy.allows_origin(origin):
        return web.Response(status=204, headers=_PREFLIGHT_HEADERS)
    if (
        request.method == "POST"
        and request.body_exists
        and request.content_type != "application/json"
    ):
        raise ApiError(
            415,
            f"the body must be JSON (Content-Type: application/json), got {request.content_type!r}",
            code="unsupported_media_type",
        )
    return await handler(request)


async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: CORS headers for an allowed origin, before any byte is sent."""
    origin = request.headers.get("Origin", "")
    if POLICY in request.app and request.app[POLICY].allows_origin(origin):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"


def install(
    app: web.Application, bind: str, hosts: tuple[str, ...], origins: tuple[str, ...]
) -> None:
    """The policy and its CORS signal on ``app`` (whose middlewares include ``browser_guard``)."""
    app[POLICY] = BrowserPolicy.build(bind, hosts, origins)
    app.on_response_prepare.append(cors_headers)
