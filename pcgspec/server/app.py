"""The aiohttp application: routes, error / auth / drain middlewares, and ``run_server``."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from dataclasses import asdict
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from pcgspec.config import EngineConfig
from pcgspec.engine.collector import freeze_start_up
from pcgspec.sampling_params import SamplingParams
from pcgspec.server.admission import admission, listen
from pcgspec.server.async_engine import AsyncEngine, EngineDeadError, Generation
from pcgspec.server.browser import browser_guard
from pcgspec.server.browser import install as install_browser_policy
from pcgspec.server.connections import install_log_filters
from pcgspec.server.engine_loop import log_slow_collections
from pcgspec.server.metrics import graph_summary
from pcgspec.server.openai_api import chat_completions, completions
from pcgspec.server.protocol import ApiError
from pcgspec.server.state import STATE, ServerSettings, ServerState

logger = logging.getLogger("pcgspec")
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
_KEYED = ("/server_info", "/get_server_info", "/health_generate", "/flush_cache")


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure as an OpenAI error body; nothing a client sends takes the server down."""
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        error = ApiError(e.status, e.reason, code=_HTTP_CODES.get(e.status))
        return web.json_response(error.body(), status=e.status)
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:  # the client hung up mid-response; writing this one fails quietly
        logger.debug("client went away on %s %s", request.method, request.path)
        return web.Response(status=499, reason="Client Closed Request")
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        error = ApiError(500, "internal server error", type="internal_error")
        return web.json_response(error.body(), status=500)


@web.middleware
async def _gate(request: web.Request, handler: Any) -> web.StreamResponse:
    """503 on /v1/* while draining; the Bearer key, when one is set, on /v1/* and on the routes
    that reveal the configuration or run the model."""
    state = request.app[STATE]
    v1 = request.path.startswith("/v1/")
    if v1 and state.draining:
        raise ApiError(503, "the server is shutting down", type="service_unavailable")
    key = state.settings.api_key
    if key is not None and (v1 or request.path in _KEYED) and not _key_matches(request, key):
        raise ApiError(
            401,
            "missing or wrong API key (send 'Authorization: Bearer <key>')",
            code="invalid_api_key",
        )
    return await handler(request)


def _key_matches(request: web.Request, key: str) -> bool:
    # NOTE: aiohttp keeps non-UTF-8 header bytes as surrogates; surrogateescape gives them back.
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {key}".encode())


def _check_available(state: ServerState) -> None:
    """503 (``ApiError``) while draining, once the engine loop is gone, and for good once the
    engine is unhealthy (its steps fail and will go on failing: ``EngineLoop._note_failure``).
    """
    engine = state.engine
    if state.draining:
        reason = "the server is shutting down"
    elif not engine.alive:
        reason = "the engine loop is not running"
    elif engine.snapshot.unhealthy is not None:
        reason = f"the engine is unhealthy: {engine.snapshot.unhealthy}"
    else:
        return
    raise ApiError(503, reason, type="service_unavailable")


async def health(request: web.Request) -> web.Response:
    _check_available(request.app[STATE])
    return web.json_response({"status": "ok"})


async def health_generate(request: web.Request) -> web.Response:
    """200 once a one-token greedy probe went through the engine."""
    state = request.app[STATE]
    _check_available(state)
    gen = Generation(state.engine)
    probe = SamplingParams(temperature=0.0, max_tokens=1)
    token = state.tokenizer.bos_token_id or 0

    async def run() -> None:
        await gen.add(f"health-{id(gen)}", [token], probe)
        async for _ in gen.updates():
            pass

    try:
        await asyncio.wait_for(run(), timeout=60)
    except (asyncio.TimeoutError, EngineDeadError) as e:
        raise ApiError(503, f"the probe failed: {e!r}", type="service_unavailable") from e
    finally:
        gen.abort()
    return web.json_response({"status": "ok"})


async def flush_cache(request: web.Request) -> web.Response:
    """Drop every cached prefix (SGLang's ``/flush_cache``); running requests keep their pages,
    so it is safe at any time. 503 when the engine loop is not running."""
    try:
        await asyncio.wait_for(request.app[STATE].engine.flush_cache(), timeout=60)
    except (asyncio.TimeoutError, EngineDeadError) as e:
        return web.json_response({"status": f"unavailable: {e!r}"}, status=503)
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[STATE])]})


async def model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if request.match_info["model"] != state.limits.model_name:
        raise ApiError(
            404,
            f"The model {request.match_info['model']!r} does not exist",
            param="model",
            code="model_not_found",
        )
    return web.json_response(_model_card(state))


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.limits.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "pcgspec",
        "max_model_len": state.limits.max_model_len,
    }


async def server_info(request: web.Request) -> web.Response:
    """The configuration and the engine's internal state (SGLang's ``/server_info``)."""
    state = request.app[STATE]
    snap = state.engine.snapshot
    stats = snap.stats
    total = stats.get("kv_pages_total", 0)
    internal = {
        "avg_spec_accept_length": snap.spec.get("avg_spec_accept_length"),
        "speculative": snap.spec,
        "graphs": graph_summary(snap.graphs),  # runs and fallbacks by reason, per runner
        "kv": {
            "used_pages": stats.get("kv_pages_used", 0),  # held by requests
            "cached_pages": stats.get("kv_pages_cached", 0),  # held by the prefix cache
            "total_pages": total,
            "page_size": stats.get("page_size"),
            "usage": stats.get("kv_pages_used", 0) / total if total else 0.0,
        },
        "prefix_cache": snap.cache,  # empty with --disable-radix-cache
        "num_running": stats.get("num_running", 0),
        "num_waiting": stats.get("num_waiting", 0),
        "num_preemptions": stats.get("num_preemptions", 0),
        "num_open_requests": len(state.engine.streams),
        "num_aborted": snap.num_aborted,
        "num_steps": snap.num_steps,
        "step_times": snap.steps,  # per kind of step: steps run, seconds in the engine's step
        "num_step_errors": snap.num_step_errors,
        "engine_alive": state.engine.alive,
        "engine_unhealthy": snap.unhealthy,  # None while healthy
    }
    settings = {k: v for k, v in asdict(state.settings).items() if k != "api_key"}
    info = state.engine.info
    return web.json_response(
        {
            "model_path": info.model_dir if info else None,
            "served_model_name": state.limits.model_name,
            "context_length": info.context_length if info else None,
            "max_model_len": state.limits.max_model_len,
            "config": asdict(state.config),
            "server_args": {**settings, "api_key_set": state.settings.api_key is not None},
            "internal_states": [internal],
        }
    )


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(state: ServerState) -> web.Application:
    app = web.Application(
        middlewares=[admission, _errors, browser_guard, _gate],
        client_max_size=state.settings.max_request_bytes,
    )
    app[STATE] = state
    settings = state.settings
    install_browser_policy(app, settings.host, settings.allowed_hosts, settings.allowed_origins)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


def run_server(config: EngineConfig, settings: ServerSettings) -> int:
    """Load the engine, serve until SIGTERM / SIGINT, drain or abort, exit. Returns 0, or 1
    when the engine loop died."""
    return asyncio.run(_serve(config, settings))


async def _serve(config: EngineConfig, settings: ServerSettings) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    install_log_filters()
    log_slow_collections("server")
    engine = AsyncEngine(in_process=settings.engine_in_process)
    await engine.start(config)
    if stop.is_set():  # Ctrl-C / SIGTERM while the model loaded: never announce "serving"
        await engine.stop()
        logger.info("interrupted during start-up")
        return 130
    state = ServerState.build(engine, config, settings)
    freeze_start_up()
    runner = web.AppRunner(
        build_app(state),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=2.0,
        keepalive_timeout=settings.keep_alive_timeout,
    )
    await runner.setup()
    listener = await listen(
        runner,
        settings.host,
        settings.port,
        settings.max_connections,
        settings.max_connections_per_peer,
        settings.header_timeout,
    )
    logger.info(
        "serving %s on http://%s:%d (max model length %d tokens)",
        state.limits.model_name,
        settings.host,
        settings.port,
        state.limits.max_model_len,
    )
    while not stop.is_set() and engine.alive:
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass
    died = not engine.alive
    await _shutdown(state, runner, listener)
    return 1 if died else 0


async def _shutdown(state: ServerState, runner: web.AppRunner, listener: asyncio.Server) -> None:
    """Refuse new requests, let running ones finish for the grace period, abort the rest."""
    state.draining = True
    engine = state.engine
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.settings.graceful_shutdown_timeout
    while engine.streams and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if engine.streams:
        logger.info("shutting down: aborting %d requests", len(engine.streams))
        engine.abort_all()
        deadline = loop.time() + 5.0
        while engine.streams and engine.alive and loop.time() < deadline:
            await asyncio.sleep(0.05)
    listener.close()
    await runner.cleanup()
    await engine.stop()
    state.encoder.shutdown()
    logger.info("server stopped")
