"""What a web page cannot do to a server it reaches: POST a body that is not JSON (415), use a
loopback server through another host name (DNS rebinding: 421), read answers from an origin not
allowed (no CORS headers). A second or two, no model.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pcgspec.server import app as server_app
from pcgspec.server.browser import BrowserPolicy, browser_guard, host_name, install, is_loopback

ALLOWED = "https://app.example"


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def _call(bind: str, hosts: tuple[str, ...], origins: tuple[str, ...], *requests: dict) -> list:
    """(status, headers, JSON body) of each request against an app under the browser policy."""

    async def run() -> list[tuple[int, Any, Any]]:
        app = web.Application(middlewares=[server_app._errors, browser_guard])
        install(app, bind, hosts, origins)
        app.router.add_get("/v1/models", _ok)
        app.router.add_post("/v1/completions", _ok)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        out = []
        try:
            async with aiohttp.ClientSession() as session:
                for r in requests:
                    url = f"http://127.0.0.1:{port}{r.pop('path')}"
                    async with session.request(r.pop("method", "GET"), url, **r) as resp:
                        body = (
                            await resp.json() if resp.content_type == "application/json" else None
                        )
                        out.append((resp.status, resp.headers, body))
        finally:
            await runner.cleanup()
        return out

    return asyncio.run(run())


def test_a_post_body_must_be_json():
    json_post = {"method": "POST", "path": "/v1/completions", "data": b"{}"}
    plain, form, ok, charset, empty, zero = _call(
        "127.0.0.1",
        (),
        (),
        {**json_post, "headers": {"Content-Type": "text/plain", "Origin": "https://evil.example"}},
        {**json_post, "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
        {**json_post, "headers": {"Content-Type": "application/json"}},
        {**json_post, "headers": {"Content-Type": "application/json; charset=utf-8"}},
        {"method": "POST", "path": "/v1/completions"},
        {
            **json_post,
            "data": b"",
            "headers": {"Content-Type": "application/x-www-form-urlencoded"},
        },
    )
    for status, headers, body in (plain, form):
        assert status == 415 and body["error"]["code"] == "unsupported_media_type"
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert "Access-Control-Allow-Origin" not in headers
    assert "text/plain" in plain[2]["error"]["message"]
    assert ok[0] == charset[0] == empty[0] == zero[0] == 200  # no body: nothing to check


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("localhost:30000", 200),
        ("127.0.0.1:8080", 200),
        ("[::1]:30000", 200),
        ("LOCALHOST", 200),
        ("evil.example", 421),
        ("evil.example:30000", 421),
        ("127.0.0.1.evil.example", 421),
        ("models.internal:30000", 200),
    ],
)
def test_a_loopback_server_answers_only_its_own_host_names(host, status):
    [(got, _, body)] = _call(
        "127.0.0.1", ("models.internal",), (), {"path": "/v1/models", "headers": {"Host": host}}
    )
    assert got == status, body
    if status != 200:
        assert body["error"]["code"] == "host_not_allowed"


def test_the_host_check_is_off_for_wildcards_and_non_loopback_binds():
    assert BrowserPolicy.build("127.0.0.1", ("*",), ()).hosts is None
    assert BrowserPolicy.build("0.0.0.0", (), ()).hosts is None
    assert BrowserPolicy.build("::1", (), ()).hosts is not None
    assert [is_loopback(h) for h in ("localhost", "127.0.0.5", "::1", "10.0.0.1")] == [
        True,
        True,
        True,
        False,
    ]
    assert host_name("[::1]:80") == "[::1]" and host_name("A.b:1") == "a.b"
    assert "gpu.lan" in BrowserPolicy.build("::1", ("GPU.lan:8000",), ()).hosts


def test_cors_headers_only_for_allowed_origins():
    preflight = {
        "method": "OPTIONS",
        "path": "/v1/completions",
        "headers": {"Origin": ALLOWED, "Access-Control-Request-Method": "POST"},
    }
    allowed, other, pre, pre_other = _call(
        "127.0.0.1",
        (),
        (ALLOWED,),
        {"path": "/v1/models", "headers": {"Origin": ALLOWED}},
        {"path": "/v1/models", "headers": {"Origin": "https://evil.example"}},
        preflight,
        {**preflight, "headers": {"Origin": "https://evil.example"}},
    )
    assert allowed[0] == 200 and allowed[1]["Access-Control-Allow-Origin"] == ALLOWED
    assert other[0] == 200 and "Access-Control-Allow-Origin" not in other[1]
    assert pre[0] == 204 and pre[1]["Access-Control-Allow-Origin"] == ALLOWED
    assert "Authorization" in pre[1]["Access-Control-Allow-Headers"]
    assert pre_other[0] == 405 and "Access-Control-Allow-Origin" not in pre_other[1]
    [(status, headers, _)] = _call(
        "127.0.0.1", (), (), {"path": "/v1/models", "headers": {"Origin": ALLOWED}}
    )
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
